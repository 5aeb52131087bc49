"""The secrets of a containerised deployment (deploy/docker-compose.yml, ``make deploy``): NATS and etcd
passwords, the gateway's API key and the engines' API key, each an environment variable.

Compose files name them as ``${VAR:?...}`` (compose reads them from the ``.env`` file next to the compose
file and refuses to start without them); the nats-server config names them as ``$VAR`` (nats-server reads its
environment), so neither file holds a secret and both can be committed or rendered deterministically.
``python -m services.deploy secrets --out FILE`` writes random values for every variable missing from FILE.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable
from pathlib import Path

from shared.protocol import Subjects
from shared.protocol.permissions import user_permissions, worker_user
from shared.security import ETCD_USER, NatsUser, nats_config, new_secret

ETCD_ROOT_VAR = "POISE_ETCD_ROOT_PASSWORD"
ETCD_VAR = "POISE_ETCD_PASSWORD"
API_KEY_VAR = "POISE_API_KEY"
ENGINE_KEY_VAR = "POISE_ENGINE_API_KEY"  # the engines' --api-key, held by the gateway and the sidecars
NATS_CONFIG_PATH = "/etc/nats/nats-server.conf"  # where the containers mount it
HINT = "run python -m services.deploy secrets"  # no ": " (YAML)
_REF = re.compile(r"\$\{(POISE_[A-Z0-9_]+)")


def nats_password_var(user: str) -> str:
    """``worker-p0`` -> ``POISE_NATS_PASSWORD_WORKER_P0``."""
    return "POISE_NATS_PASSWORD_" + re.sub(r"[^A-Z0-9]", "_", user.upper())


def ref(var: str) -> str:
    """A compose reference that fails with a hint when the variable is not set."""
    return f"${{{var}:?{HINT}}}"


def nats_users(namespace: str, worker_ids: Iterable[str]) -> list[NatsUser]:
    """Every NATS user of a deployment, with its password read from the environment (``$VAR``)."""
    return [NatsUser(user, "$" + nats_password_var(user), p)
            for user, p in user_permissions(Subjects(namespace), worker_ids).items()]


def nats_server_config(namespace: str, worker_ids: Iterable[str]) -> str:
    header = (f"# nats-server users of a Poise deployment (namespace {namespace}): passwords come from the environment\n"
              f"# (POISE_NATS_PASSWORD_<USER>, {HINT}); permissions from shared/protocol/permissions.py.\n")
    return header + nats_config(nats_users(namespace, worker_ids))


def nats_server_env(namespace: str, worker_ids: Iterable[str]) -> dict[str, str]:
    """nats-server's environment: every user's password variable."""
    return {nats_password_var(u.user): ref(nats_password_var(u.user)) for u in nats_users(namespace, worker_ids)}


def etcd_password_var(instance_id: str) -> str:
    """``p0`` -> ``POISE_ETCD_PASSWORD_WORKER_P0``: the etcd password of that sidecar's own user."""
    return "POISE_ETCD_PASSWORD_" + re.sub(r"[^A-Z0-9]", "_", worker_user(instance_id).upper())


def service_env(prefix: str, nats_user: str) -> dict[str, str]:
    """A Poise process's credentials (``prefix``: its settings' env prefix, e.g. ``POISE_GATEWAY_``)."""
    return {prefix + "NATS_USER": nats_user, prefix + "NATS_PASSWORD": ref(nats_password_var(nats_user)),
            prefix + "ETCD_USER": ETCD_USER, prefix + "ETCD_PASSWORD": ref(ETCD_VAR)}


def worker_env(instance_id: str) -> dict[str, str]:
    """A sidecar's: its own NATS and etcd users (the etcd one may write its instance key only), the engine key."""
    return {**service_env("POISE_WORKER_", worker_user(instance_id)),
            "POISE_WORKER_ETCD_USER": worker_user(instance_id),
            "POISE_WORKER_ETCD_PASSWORD": ref(etcd_password_var(instance_id)),
            "POISE_WORKER_ENGINE_API_KEY": ref(ENGINE_KEY_VAR)}


def etcd_auth_env(worker_ids: Iterable[str] = ()) -> dict[str, str]:
    """The etcd-auth job's: root's and the ``poise`` user's passwords, and each sidecar's user's."""
    return {ETCD_ROOT_VAR: ref(ETCD_ROOT_VAR), ETCD_VAR: ref(ETCD_VAR),
            **{etcd_password_var(i): ref(etcd_password_var(i)) for i in worker_ids}}


def gateway_api_keys_env() -> dict[str, str]:
    return {"POISE_GATEWAY_API_KEYS": f'["${{{API_KEY_VAR}:?{HINT}}}"]', "POISE_GATEWAY_ENGINE_API_KEY": ref(ENGINE_KEY_VAR)}


def all_variables(namespace: str, worker_ids: Iterable[str]) -> list[str]:
    ids = list(worker_ids)
    return [*nats_server_env(namespace, ids), ETCD_ROOT_VAR, ETCD_VAR, *(etcd_password_var(i) for i in ids),
            API_KEY_VAR, ENGINE_KEY_VAR]


def referenced(text: str) -> list[str]:
    """The variables a compose file references, in order of first use."""
    return list(dict.fromkeys(_REF.findall(text)))


def read_env_file(path: Path) -> dict[str, str]:
    values: dict[str, str] = {}
    for line in path.read_text().splitlines():
        line = line.strip()
        if line and not line.startswith("#") and "=" in line:
            key, value = line.split("=", 1)
            values[key.strip()] = value.strip().strip("'\"")
    return values


def env_file_text(values: dict[str, str]) -> str:
    return "# Poise deployment secrets: keep this file private (mode 0600); never commit it.\n" + "".join(
        f"{k}={v}\n" for k, v in values.items())


def write_private(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.chmod(path, 0o600)


def ensure_secrets(path: Path, variables: Iterable[str]) -> dict[str, str]:
    """The secrets in ``path``, with a random value added for each of ``variables`` it lacks (file kept 0600)."""
    values = read_env_file(path) if path.exists() else {}
    missing = [v for v in variables if not values.get(v)]
    if missing or not path.exists():
        values.update({v: new_secret() for v in missing})
        write_private(path, env_file_text(values))
    return values
