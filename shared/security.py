"""Credentials of a Poise deployment, and what turns them on: nats-server users, etcd auth, the gateway's key.

- **NATS**: one user per principal (every service, ``poise admin``, one per worker sidecar) with the
  permissions of :mod:`shared.protocol.permissions`; :func:`nats_config` writes the ``authorization`` block
  of a nats-server config file, with each password as a bcrypt hash (nats-server checks a client's password
  against it), so the file itself holds no credential.
- **etcd**: a ``root`` user (etcd needs one to turn auth on) and one ``poise`` user whose role may read and
  write the ``/poise/`` prefix and nothing else; :func:`enable_etcd_auth` sets them up and turns auth on.
- **gateway**: bearer API keys (``GatewaySettings.api_keys``).

The dev stack generates random ones per run (:meth:`Credentials.generate`, kept in
``<run dir>/credentials.json`` with mode 0600); a deployment keeps them in a secrets file of its own.
"""

from __future__ import annotations

import json
import os
import secrets
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import bcrypt
import msgspec

from shared.errors import PoiseError
from shared.protocol.permissions import Permissions, worker_user

ETCD_ROOT = "root"
ETCD_USER = "poise"
ETCD_ROLE = "poise"
ETCD_PREFIX = "/poise/"  # every key Poise writes (shared/protocol/keys.py) is under it


def new_secret() -> str:
    """A random password or API key (32 URL-safe characters, 192 bits)."""
    return secrets.token_urlsafe(24)


class Credentials(msgspec.Struct, kw_only=True):
    """Passwords of one deployment; a file of it is written with mode 0600 (:meth:`write`)."""

    nats: dict[str, str] = msgspec.field(default_factory=dict)  # NATS user -> password
    etcd_user: str | None = None
    etcd_password: str | None = None
    etcd_root_password: str | None = None
    api_key: str | None = None  # the gateway's bearer key
    engine_api_key: str | None = None  # the engines' (SGLang --api-key): held by the gateway and the sidecars
    # etcd user per sidecar (instance id -> password; the user is worker_user(id)): it may write its own
    # instance key only (:func:`enable_etcd_auth`)
    etcd_workers: dict[str, str] = msgspec.field(default_factory=dict)

    @classmethod
    def generate(cls, nats_users: Iterable[str], *, api_key: str | None = None,
                 etcd_workers: Iterable[str] = ()) -> Credentials:
        return cls(nats={u: new_secret() for u in nats_users}, etcd_user=ETCD_USER, etcd_password=new_secret(),
                   etcd_root_password=new_secret(), api_key=api_key if api_key is not None else new_secret(),
                   engine_api_key=new_secret(), etcd_workers={i: new_secret() for i in etcd_workers})

    def etcd_login(self, instance_id: str | None = None) -> tuple[str | None, str | None]:
        """(user, password) a process logs in to etcd with: a sidecar's own user when there is one."""
        if instance_id is not None and instance_id in self.etcd_workers:
            return worker_user(instance_id), self.etcd_workers[instance_id]
        return self.etcd_user, self.etcd_password

    def nats_password(self, user: str) -> str:
        try:
            return self.nats[user]
        except KeyError:
            raise PoiseError(f"no NATS credentials for user {user!r}") from None

    def subset(self, nats_users: Iterable[str], etcd_workers: Iterable[str] = ()) -> Credentials:
        """Only these NATS users and sidecars' etcd users, and the etcd ``poise`` user: what one process may be
        handed."""
        return Credentials(nats={u: self.nats[u] for u in nats_users if u in self.nats}, etcd_user=self.etcd_user,
                           etcd_password=self.etcd_password, engine_api_key=self.engine_api_key,
                           etcd_workers={i: self.etcd_workers[i] for i in etcd_workers if i in self.etcd_workers})

    def write(self, path: Path) -> None:
        """Write as JSON, readable by this user only (created 0600; never world-readable, not even briefly)."""
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(msgspec.json.format(msgspec.json.encode(self), indent=2))
        os.chmod(path, 0o600)

    @classmethod
    def read(cls, path: Path) -> Credentials:
        try:
            return msgspec.json.decode(path.read_bytes(), type=cls)
        except (OSError, msgspec.DecodeError) as exc:
            raise PoiseError(f"cannot read credentials from {path}: {exc}") from exc


def without_secrets(env: dict[str, str]) -> dict[str, str]:
    """``env`` without Poise's passwords and keys: what a child that needs none of them inherits (engines)."""
    return {k: v for k, v in env.items()
            if not (k.startswith("POISE_") and k.endswith(("_PASSWORD", "_API_KEYS", "_API_KEY")))}


# -- NATS --------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class NatsUser:
    """One nats-server user. ``password`` is the password itself (the config gets its bcrypt hash), or ``$NAME``
    to have nats-server read it from its environment (deployments); ``permissions`` None = every subject (the
    tests' own user)."""

    user: str
    password: str
    permissions: Permissions | None


def _q(value: str) -> str:
    return json.dumps(value)  # a JSON string is a valid nats-server config string


# bcrypt's lowest work factor: the passwords are random 192-bit secrets (new_secret), which no work factor makes
# any harder or easier to guess; the hash is there so that the config file holds no usable password. A higher
# factor would cost every NATS connection its time (nats-server checks the hash at each connect).
BCRYPT_ROUNDS = 4


def bcrypt_hash(password: str) -> str:
    """The password's bcrypt hash, in the ``$2b$`` form nats-server accepts in place of a password."""
    return bcrypt.hashpw(password.encode(), bcrypt.gensalt(BCRYPT_ROUNDS)).decode()


def _allow(subjects: Sequence[str]) -> str:
    return "{allow: [" + ", ".join(_q(s) for s in subjects) + "]}"


def _permissions(p: Permissions) -> str:
    parts = []
    if p.publish:
        parts.append(f"publish: {_allow(p.publish)}")
    elif not p.respond:  # allow_responses denies every other publish by itself
        parts.append('publish: {deny: [">"]}')
    parts.append(f"subscribe: {_allow(p.subscribe)}" if p.subscribe else 'subscribe: {deny: [">"]}')
    if p.respond:
        parts.append("allow_responses: true")
    return "{" + ", ".join(parts) + "}"


def nats_config(users: Sequence[NatsUser]) -> str:
    """The ``authorization`` block of a nats-server config file with these users."""
    lines = ["# Poise NATS users: permissions from shared/protocol/permissions.py (rendered by shared/security.py).",
             "authorization {", "  users = ["]
    for u in users:
        password = u.password if u.password.startswith("$") else _q(bcrypt_hash(u.password))
        entry = f"user: {_q(u.user)}, password: {password}"
        if u.permissions is not None:
            entry += f", permissions: {_permissions(u.permissions)}"
        lines.append(f"    {{{entry}}}")
    lines += ["  ]", "}", ""]
    return "\n".join(lines)


def url_with_credentials(url: str, user: str | None, password: str | None) -> str:
    """``scheme://user:password@host:port`` (how the tests' servers hand out a ready-to-use URL)."""
    if not user:
        return url
    scheme, sep, rest = url.partition("://")
    if not sep:
        scheme, rest = "", url
    cred = user if password is None else f"{user}:{password}"
    return f"{scheme}{sep}{cred}@{rest.rsplit('@', 1)[-1]}"


def redact_url(url: str) -> str:
    """``url`` with any password replaced by ``***`` (for logs and error messages)."""
    out = []
    for part in url.split(","):
        scheme, sep, rest = part.partition("://")
        if sep and "@" in rest:
            cred, host = rest.rsplit("@", 1)
            user = cred.split(":", 1)[0]
            part = f"{scheme}://{user}:***@{host}"
        out.append(part)
    return ",".join(out)


# -- etcd --------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class EtcdAuth:
    """What :func:`enable_etcd_auth` sets up: ``root``, one user with read-write on the ``/poise/`` prefix, and
    per sidecar (``workers``: user -> (password, its instance key)) a user that may read the prefix and write
    its own instance key only."""

    root_password: str
    password: str
    user: str = ETCD_USER
    workers: dict[str, tuple[str, str]] = field(default_factory=dict)

    @classmethod
    def generate(cls) -> EtcdAuth:
        return cls(root_password=new_secret(), password=new_secret())

    @classmethod
    def of(cls, credentials: Credentials, instance_key: Callable[[str], str] | None = None) -> EtcdAuth:
        """``instance_key``: an instance id's etcd key (``Keys(namespace).instance``), for the sidecars' users."""
        if not (credentials.etcd_root_password and credentials.etcd_password):
            raise PoiseError("the credentials have no etcd passwords")
        workers = {worker_user(i): (pw, instance_key(i)) for i, pw in credentials.etcd_workers.items()} \
            if instance_key is not None else {}
        return cls(root_password=credentials.etcd_root_password, password=credentials.etcd_password,
                   user=credentials.etcd_user or ETCD_USER, workers=workers)


def prefix_range_end(prefix: str) -> bytes:
    """etcd's range end of every key starting with ``prefix``."""
    key = bytearray(prefix.encode())
    key[-1] += 1
    return bytes(key)


def enable_etcd_auth(endpoint: str, *, root_password: str, user: str = ETCD_USER, password: str,
                     prefix: str = ETCD_PREFIX, timeout_s: float = 10.0,
                     workers: Mapping[str, tuple[str, str]] | None = None) -> bool:
    """Create ``root`` and ``user`` (read-write on ``prefix`` only) and turn etcd's auth on. ``workers``
    (user -> (password, key)): users, each with its own role, that may read ``prefix`` and write ``key`` only.

    ``endpoint`` is ``host:port``. Returns False when auth was already on (nothing is changed: a restarted dev
    server, or a deployment's second start). Safe to run again after a half-finished run.
    """
    import grpc
    from aetcd import rpc

    with grpc.insecure_channel(endpoint) as channel:
        auth = rpc.AuthStub(channel)

        def exists(call: Any, request: Any) -> bool:
            """Run one call; True when what it creates was already there."""
            try:
                call(request, timeout=timeout_s)
            except grpc.RpcError as exc:
                if "already exists" in (exc.details() or ""):  # type: ignore[attr-defined]
                    return True
                raise
            return False

        def add_user(name: str, secret: str) -> None:
            if exists(auth.UserAdd, rpc.AuthUserAddRequest(name=name, password=secret)):
                auth.UserChangePassword(rpc.AuthUserChangePasswordRequest(name=name, password=secret), timeout=timeout_s)

        try:
            if auth.AuthStatus(rpc.AuthStatusRequest(), timeout=timeout_s).enabled:
                return False
        except grpc.RpcError as exc:
            if "user name is empty" in (exc.details() or ""):  # type: ignore[attr-defined]
                return False  # auth is on: etcd answers nothing, not even this, without credentials
            raise
        add_user(ETCD_ROOT, root_password)
        exists(auth.RoleAdd, rpc.AuthRoleAddRequest(name=ETCD_ROOT))
        auth.UserGrantRole(rpc.AuthUserGrantRoleRequest(user=ETCD_ROOT, role=ETCD_ROOT), timeout=timeout_s)
        exists(auth.RoleAdd, rpc.AuthRoleAddRequest(name=ETCD_ROLE))
        auth.RoleGrantPermission(rpc.AuthRoleGrantPermissionRequest(name=ETCD_ROLE, perm=rpc.Permission(
            permType=rpc.Permission.READWRITE, key=prefix.encode(), range_end=prefix_range_end(prefix))),
            timeout=timeout_s)
        add_user(user, password)
        auth.UserGrantRole(rpc.AuthUserGrantRoleRequest(user=user, role=ETCD_ROLE), timeout=timeout_s)
        for worker, (secret, key) in (workers or {}).items():
            exists(auth.RoleAdd, rpc.AuthRoleAddRequest(name=worker))
            auth.RoleGrantPermission(rpc.AuthRoleGrantPermissionRequest(name=worker, perm=rpc.Permission(
                permType=rpc.Permission.READ, key=prefix.encode(), range_end=prefix_range_end(prefix))),
                timeout=timeout_s)
            auth.RoleGrantPermission(rpc.AuthRoleGrantPermissionRequest(name=worker, perm=rpc.Permission(
                permType=rpc.Permission.READWRITE, key=key.encode())), timeout=timeout_s)  # this one key
            add_user(worker, secret)
            auth.UserGrantRole(rpc.AuthUserGrantRoleRequest(user=worker, role=worker), timeout=timeout_s)
        auth.AuthEnable(rpc.AuthEnableRequest(), timeout=timeout_s)
    return True
