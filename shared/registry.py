"""The etcd adapter: instance registration under a lease, a live mirror of the instances, leader election.

Membership is etcd's job: a sidecar's instance key lives under its lease, so the key disappears when the
sidecar dies and stops refreshing it. Everything here reconnects and resyncs by itself; callers see a
consistent ``dict[instance_id, InstanceInfo]`` and a boolean ``is_leader``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from typing import Any
from urllib.parse import unquote, urlparse

import aetcd
import aetcd.exceptions
import grpc
from aetcd import rpc, watcher

from shared.errors import PoiseError, ProtocolError
from shared.protocol import InstanceInfo, Keys, PlannerPause, decode, encode
from shared.security import redact_url

log = logging.getLogger(__name__)

# aetcd raises its own ClientError family; grpc errors can leak out of the watcher.
ETCD_ERRORS: tuple[type[BaseException], ...] = (aetcd.exceptions.ClientError, grpc.RpcError, OSError, asyncio.TimeoutError)


def _parse_url(url: str) -> tuple[str, int, str | None, str | None]:
    """host, port, and the user and password of ``http://user:password@host:port`` (None when absent)."""
    parsed = urlparse(url if "://" in url else f"http://{url}")
    return (parsed.hostname or "127.0.0.1", parsed.port or 2379, unquote(parsed.username) if parsed.username else None,
            unquote(parsed.password) if parsed.password else None)


def _refused(exc: BaseException) -> bool:
    """etcd turned the credentials down, or wants some: retrying will not help."""
    text = str(exc)
    return any(m in text for m in ("authentication failed", "user name is empty", "permission denied",
                                   "invalid user ID or password"))


class _TokenAuth:
    """Puts the current etcd auth token on every call, and logs in again when etcd no longer knows it.

    aetcd logs in once, at connect. etcd forgets its tokens when it restarts (simple tokens) or when they
    expire (5 minutes unused, or a JWT's TTL); a call then fails UNAUTHENTICATED. Here such a unary call
    logs in again and is retried once; a stream (watch, lease keep-alive) gets the newest token when it starts.
    """

    def __init__(self, user: str, password: str, timeout_s: float | None) -> None:
        self._user = user
        self._password = password
        self._timeout_s = timeout_s
        self.token: str | None = None
        self.stub: rpc.AuthStub | None = None
        self._lock = asyncio.Lock()

    def interceptors(self) -> list[grpc.aio.ClientInterceptor]:
        # grpc.aio files an interceptor under the first kind it is an instance of: one object per kind.
        return [_UnaryUnary(self), _UnaryStream(self), _StreamUnary(self), _StreamStream(self)]

    async def login(self, stale: str | None = None) -> None:
        async with self._lock:
            if self.token is not None and self.token != stale:
                return  # another call logged in meanwhile
            assert self.stub is not None
            reply = await self.stub.Authenticate(rpc.AuthenticateRequest(name=self._user, password=self._password),
                                                 timeout=self._timeout_s)
            self.token = reply.token

    @staticmethod
    def is_login(details: grpc.aio.ClientCallDetails) -> bool:
        method = details.method.decode() if isinstance(details.method, bytes) else str(details.method)
        return method.endswith("/Authenticate")

    def with_token(self, details: grpc.aio.ClientCallDetails) -> grpc.aio.ClientCallDetails:
        if self.token is None or self.is_login(details):
            return details
        metadata = tuple((k, v) for k, v in (details.metadata or ()) if k != "token") + (("token", self.token),)
        return details._replace(metadata=metadata)  # type: ignore[attr-defined, no-any-return]

    async def unary_unary(self, continuation: Any, details: grpc.aio.ClientCallDetails, request: Any) -> Any:
        token = self.token
        call = await continuation(self.with_token(details), request)
        if self.is_login(details):
            return call
        try:
            return await call
        except grpc.aio.AioRpcError as exc:
            if exc.code() != grpc.StatusCode.UNAUTHENTICATED:
                raise
            log.info("etcd auth token no longer valid (%s); logging in again", exc.details())
        await self.login(stale=token)
        return await (await continuation(self.with_token(details), request))


class _UnaryUnary(grpc.aio.UnaryUnaryClientInterceptor):
    def __init__(self, auth: _TokenAuth) -> None:
        self._auth = auth

    async def intercept_unary_unary(self, continuation: Any, details: grpc.aio.ClientCallDetails, request: Any) -> Any:
        return await self._auth.unary_unary(continuation, details, request)


class _UnaryStream(grpc.aio.UnaryStreamClientInterceptor):
    def __init__(self, auth: _TokenAuth) -> None:
        self._auth = auth

    async def intercept_unary_stream(self, continuation: Any, details: grpc.aio.ClientCallDetails, request: Any) -> Any:
        return await continuation(self._auth.with_token(details), request)


class _StreamUnary(grpc.aio.StreamUnaryClientInterceptor):
    def __init__(self, auth: _TokenAuth) -> None:
        self._auth = auth

    async def intercept_stream_unary(self, continuation: Any, details: grpc.aio.ClientCallDetails, requests: Any) -> Any:
        return await continuation(self._auth.with_token(details), requests)


class _StreamStream(grpc.aio.StreamStreamClientInterceptor):
    def __init__(self, auth: _TokenAuth) -> None:
        self._auth = auth

    async def intercept_stream_stream(self, continuation: Any, details: grpc.aio.ClientCallDetails, requests: Any) -> Any:
        return await continuation(self._auth.with_token(details), requests)


class _AuthClient(aetcd.Client):
    """An aetcd client that logs in with a user and password and keeps its token fresh (:class:`_TokenAuth`)."""

    def __init__(self, *, host: str, port: int, username: str, password: str, timeout: int) -> None:
        super().__init__(host=host, port=port, timeout=timeout)  # no credentials: aetcd must not log in itself
        self._auth = _TokenAuth(username, password, timeout)

    async def connect(self) -> None:  # aetcd.Client.connect, with the interceptor on the channel
        if self._connected.is_set():
            return
        if self._is_connecting:  # type: ignore[has-type]
            await asyncio.wait_for(self._connected.wait(), self._connect_wait_timeout)
            return
        try:
            self._is_connecting = True
            self.channel = grpc.aio.insecure_channel(f"{self._host}:{self._port}", options=list(self._options.items()),
                                                     interceptors=self._auth.interceptors())
            self._auth.stub = rpc.AuthStub(self.channel)
            try:
                await self._auth.login()
            except grpc.aio.AioRpcError as exc:
                aetcd.exceptions._handle_exception(exc)
            self.kvstub = rpc.KVStub(self.channel)
            self.clusterstub = rpc.ClusterStub(self.channel)
            self.leasestub = rpc.LeaseStub(self.channel)
            self.maintenancestub = rpc.MaintenanceStub(self.channel)
            self._watcher = watcher.Watcher(rpc.WatchStub(self.channel), timeout=self._timeout)
            self._connected.set()
        finally:
            self._is_connecting = False


class Registry:
    """One etcd client of one process, plus the key layout of its namespace.

    With a user (``user``/``password``, or in the URL: ``http://user:password@host:port``) it logs in to etcd
    and logs in again whenever etcd has forgotten its token.
    """

    def __init__(self, url: str, keys: Keys, *, user: str | None = None, password: str | None = None,
                 connect_timeout_s: float = 30.0) -> None:
        self.keys = keys
        self._host, self._port, url_user, url_password = _parse_url(url)
        self._url = redact_url(url)
        self._user = user or url_user
        self._password = password if user else url_password
        self._connect_timeout_s = connect_timeout_s
        self._client: aetcd.Client | None = None

    @property
    def client(self) -> aetcd.Client:
        if self._client is None:
            raise PoiseError("registry is not connected")
        return self._client

    def _new_client(self) -> aetcd.Client:
        if self._user:
            return _AuthClient(host=self._host, port=self._port, username=self._user, password=self._password or "",
                               timeout=5)
        return aetcd.Client(host=self._host, port=self._port, timeout=5)

    async def connect(self) -> None:
        deadline = time.monotonic() + self._connect_timeout_s
        delay = 0.05
        while True:
            client = self._new_client()
            try:
                await client.connect()
                await client.status()  # connect() is lazy about the server being there
                await client.get(self.keys.planner_paused().encode())  # may we read our namespace?
                self._client = client
                return
            except ETCD_ERRORS as exc:
                with contextlib.suppress(*ETCD_ERRORS):
                    await client.close()
                who = f" as {self._user!r}" if self._user else " without credentials"
                if _refused(exc):
                    raise PoiseError(f"etcd at {self._url} refused access{who}: {exc}") from exc
                if time.monotonic() >= deadline:
                    raise PoiseError(f"cannot connect to etcd at {self._url}: {exc}") from exc
                await asyncio.sleep(delay)
                delay = min(delay * 2, 1.0)

    async def close(self) -> None:
        client, self._client = self._client, None
        if client is not None:
            with contextlib.suppress(*ETCD_ERRORS):
                await client.close()

    async def list_instances(self) -> tuple[dict[str, InstanceInfo], int]:
        """All registered instances and the etcd revision they were read at."""
        result = await self.client.get_prefix(self.keys.instances_prefix().encode())
        instances: dict[str, InstanceInfo] = {}
        for kv in result:
            info = _decode_instance(kv.key, kv.value)
            if info is not None:
                instances[info.instance_id] = info
        return instances, int(result.header.revision)

    async def get_instance(self, instance_id: str) -> InstanceInfo | None:
        """One instance's record (None when it is not registered or unreadable)."""
        key = self.keys.instance(instance_id).encode()
        kv = await self.client.get(key)
        return None if kv is None else _decode_instance(key, kv.value)

    async def planner_pause(self) -> PlannerPause | None:
        """The planner's pause record; None while it runs. An unreadable record counts as paused: a planner
        that cannot tell must not flip."""
        kv = await self.client.get(self.keys.planner_paused().encode())
        if kv is None:
            return None
        try:
            return decode(kv.value, PlannerPause)
        except ProtocolError as exc:
            log.warning("unreadable planner pause record (%s); treating the planner as paused", exc)
            return PlannerPause(reason=f"unreadable pause record: {exc}", replica_id="?", at_unix_s=0.0)

    async def set_planner_pause(self, pause: PlannerPause | None) -> None:
        """Write (pause) or delete (resume) the planner's pause record. No lease: a pause outlives the replica
        that took it, so a new leader after failover stays paused."""
        key = self.keys.planner_paused().encode()
        if pause is None:
            await self.client.delete(key)
        else:
            await self.client.put(key, encode(pause))


def registry_from_settings(settings: Any, keys: Keys) -> Registry:
    """A :class:`Registry` for a :class:`shared.settings.ControlPlaneSettings` (its etcd URL and credentials)."""
    return Registry(settings.etcd_url, keys, user=settings.etcd_user, password=settings.etcd_password)


def _decode_instance(key: bytes, value: bytes) -> InstanceInfo | None:
    try:
        return decode(value, InstanceInfo)
    except ProtocolError as exc:
        log.warning("ignoring malformed instance record %s: %s", key.decode(errors="replace"), exc)
        return None


class LeaseKeeper:
    """Holds an etcd lease alive; ``lost`` is set when it expired anyway (e.g. etcd was unreachable)."""

    def __init__(self, registry: Registry, ttl_s: int) -> None:
        self._registry = registry
        self.ttl_s = ttl_s
        self.lease: aetcd.leases.Lease | None = None
        self.lost = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    async def grant(self) -> aetcd.leases.Lease:
        self.lease = await self._registry.client.lease(self.ttl_s)
        self.lost.clear()
        if self._task is None or self._task.done():
            self._task = asyncio.create_task(self._keepalive(), name="etcd-lease-keepalive")
        return self.lease

    async def _keepalive(self) -> None:
        while True:
            await asyncio.sleep(self.ttl_s / 3)
            lease = self.lease
            if lease is None:
                continue
            try:
                reply = await lease.refresh()
                if reply is None or reply.TTL <= 0:
                    log.warning("etcd lease %x expired", lease.id)
                    self.lost.set()
            except ETCD_ERRORS as exc:
                log.warning("etcd lease refresh failed: %s", exc)

    async def revoke(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        lease, self.lease = self.lease, None
        if lease is not None:
            with contextlib.suppress(*ETCD_ERRORS):
                await lease.revoke()


class InstanceRegistration:
    """Keeps one :class:`InstanceInfo` in etcd under a lease, re-registering after the lease is lost."""

    def __init__(self, registry: Registry, *, ttl_s: int = 5) -> None:
        self._registry = registry
        self._keeper = LeaseKeeper(registry, ttl_s)
        self._info: InstanceInfo | None = None
        self._task: asyncio.Task[None] | None = None

    @property
    def info(self) -> InstanceInfo | None:
        return self._info

    async def register(self, info: InstanceInfo) -> None:
        self._info = info
        if self._keeper.lease is None:
            await self._keeper.grant()
        await self._put()
        if self._task is None:
            self._task = asyncio.create_task(self._watch_lease(), name="etcd-reregister")

    async def update(self, info: InstanceInfo) -> None:
        await self.register(info)

    async def _put(self) -> None:
        assert self._info is not None and self._keeper.lease is not None
        key = self._registry.keys.instance(self._info.instance_id).encode()
        await self._registry.client.put(key, encode(self._info), lease=self._keeper.lease)

    async def _watch_lease(self) -> None:
        while True:
            await self._keeper.lost.wait()
            try:
                await self._keeper.grant()
                await self._put()
                log.info("re-registered %s after losing the lease", self._info and self._info.instance_id)
            except ETCD_ERRORS as exc:
                log.warning("re-registration failed, retrying: %s", exc)
                await asyncio.sleep(1.0)

    async def deregister(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        if self._info is not None:
            with contextlib.suppress(*ETCD_ERRORS):
                await self._registry.client.delete(self._registry.keys.instance(self._info.instance_id).encode())
        await self._keeper.revoke()


class InstanceWatcher:
    """A live mirror of the registered instances.

    Lists the prefix, then watches from the next revision; on any watch failure it lists again, so the
    mirror converges after etcd restarts. ``on_change`` is called after every change.
    """

    def __init__(self, registry: Registry, on_change: Callable[[dict[str, InstanceInfo]], None] | None = None) -> None:
        self._registry = registry
        self._on_change = on_change
        self.instances: dict[str, InstanceInfo] = {}
        self.synced = asyncio.Event()
        self.watching = False  # the mirror follows etcd now (False from a watch failure until the next listing)
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="etcd-instance-watch")
        await self.synced.wait()

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None

    def _notify(self) -> None:
        if self._on_change is not None:
            self._on_change(dict(self.instances))

    async def _run(self) -> None:
        keys = self._registry.keys
        while True:
            try:
                instances, revision = await self._registry.list_instances()
                self.instances = instances
                self.synced.set()
                self.watching = True
                self._notify()
                watch = await self._registry.client.watch_prefix(keys.instances_prefix().encode(), start_revision=revision + 1)
                async for event in watch:
                    instance_id = keys.instance_id_from_key(event.kv.key.decode())
                    if event.kind == "DELETE":
                        self.instances.pop(instance_id, None)
                    else:
                        info = _decode_instance(event.kv.key, event.kv.value)
                        if info is None:
                            continue
                        self.instances[instance_id] = info
                    self._notify()
            except asyncio.CancelledError:
                raise
            except ETCD_ERRORS as exc:
                self.watching = False
                log.warning("instance watch broke (%s); resyncing", exc)
                await asyncio.sleep(0.5)


class LeaderElection:
    """At most one leader per service: the replica whose leased key exists wins.

    A replica creates ``leaders/<service>`` only if it is absent (a transaction on create revision 0);
    the others retry every ``ttl_s / 2`` seconds and take over within a lease TTL of the leader's death.
    """

    def __init__(self, registry: Registry, service: str, replica_id: str, *, ttl_s: int = 5,
                 on_change: Callable[[bool], None] | None = None) -> None:
        self._registry = registry
        self._key = registry.keys.leader(service).encode()
        self._replica_id = replica_id.encode()
        self._keeper = LeaseKeeper(registry, ttl_s)
        self._on_change = on_change
        self.is_leader = False
        self.rounds = 0  # election rounds run (won or lost): what a caller can wait on
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="leader-election")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        if self.is_leader:
            self._set(False)
        await self._keeper.revoke()  # revoking deletes the key: a follower takes over at once

    def _set(self, leader: bool) -> None:
        if leader != self.is_leader:
            self.is_leader = leader
            log.info("%s leadership of %s", "took" if leader else "lost", self._key.decode())
            if self._on_change is not None:
                self._on_change(leader)

    async def current_leader(self) -> str | None:
        value = await self._registry.client.get(self._key)
        return value.value.decode() if value is not None else None

    async def _run(self) -> None:
        client = self._registry.client
        while True:
            try:
                if self._keeper.lease is None or self._keeper.lost.is_set():
                    await self._keeper.grant()
                tx = client.transactions
                won, _ = await client.transaction(
                    compare=[tx.create(self._key) == 0],
                    success=[tx.put(self._key, self._replica_id, lease=self._keeper.lease)],
                    failure=[],
                )
                if not won:
                    holder = await client.get(self._key)
                    won = holder is not None and holder.value == self._replica_id and holder.lease == self._keeper.lease.id  # type: ignore[union-attr]
                self._set(won)
            except asyncio.CancelledError:
                raise
            except ETCD_ERRORS as exc:
                log.warning("leader election round failed: %s", exc)
                self._set(False)
            self.rounds += 1
            await asyncio.sleep(self._keeper.ttl_s / 2)
