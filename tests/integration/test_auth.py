"""Security on the real servers: NATS users with the permission matrix (shared/protocol/permissions.py), etcd
auth, wrong and missing credentials refused. The session nats-server (tests/conftest.py) has every role user
of namespace ``authz``; a refused publish or subscribe is reported by nats-server as a permissions violation,
which the Bus records (``Bus.permission_errors``) and nobody receives.
"""

from __future__ import annotations

import asyncio
import importlib.util
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import aetcd
import msgspec
import pytest
import pytest_asyncio

from services.planner.connectors import ConnectorError, LocalConnector, LocalConnectorSettings
from shared.bus import Bus
from shared.devservers import EtcdServer, NatsServer
from shared.errors import BusTimeout, PoiseError
from shared.protocol import AdminCommand, AdminReply, InstanceInfo, Keys, LoadReport, Subjects
from shared.registry import InstanceRegistration, InstanceWatcher, Registry
from shared.security import Credentials, EtcdAuth, redact_url, url_with_credentials
from tests.conftest import AUTHZ_NAMESPACE
from tests.integration.waiting import until

pytestmark = pytest.mark.asyncio
S = Subjects(AUTHZ_NAMESPACE)


def _load(instance_id: str) -> LoadReport:
    return LoadReport(instance_id=instance_id, role="decode", status="ready", ts_unix_s=time.time())


@pytest_asyncio.fixture
async def connect(nats_server: NatsServer, nats_credentials: Credentials) -> AsyncIterator[Callable[[str], object]]:
    buses: list[Bus] = []

    async def as_user(user: str) -> Bus:
        bus = Bus(nats_server.plain_url, name=f"test-{user}", user=user, password=nats_credentials.nats_password(user),
                  connect_timeout_s=5)
        await bus.connect()
        buses.append(bus)
        return bus

    yield as_user  # type: ignore[misc]
    for bus in buses:
        await bus.close()


async def _listen(bus: Bus, subject: str, message_type: type[msgspec.Struct] = LoadReport) -> list[str]:
    got: list[str] = []

    async def on(msg: object, subj: str) -> None:
        got.append(subj)

    await bus.subscribe(subject, message_type, on)
    await bus.nc.flush()
    return got


async def _settle(*buses: Bus, refused: tuple[Bus, int] | None = None) -> None:
    """Wait until what was sent has been processed: ``refused`` (bus, n) until that bus has heard n permission
    errors (the server sends one as it turns a publish or subscription down, so an allowed publish would have
    been routed by then), then a round trip on every bus (what was routed to a subscriber has arrived)."""
    if refused is not None:
        bus, n = refused
        await until(lambda: len(bus.permission_errors) >= n, 20)
    for b in buses:
        await b.nc.flush()


async def test_a_worker_publishes_only_its_own_load(connect, nats_server: NatsServer) -> None:  # type: ignore[no-untyped-def]
    p0 = await connect("worker-p0")
    observer = Bus(nats_server.url, name="observer")  # the full-access test user
    await observer.connect()
    try:
        loads = await _listen(observer, S.load_all())
        admin = await _listen(observer, S.admin_all(), AdminCommand)
        await p0.publish(S.load("p0"), _load("p0"))
        await p0.publish(S.load("p1"), _load("p1"))  # another worker's load: refused
        await p0.publish(S.admin("planner"), AdminCommand(verb="pause"))  # an admin subject: refused
        await _settle(p0, observer, refused=(p0, 2))
        assert loads == [S.load("p0")]
        assert admin == []
        assert sorted(p0.permission_errors) == sorted(
            [f'nats: permissions violation for publish to "{S.load("p1")}"',
             f'nats: permissions violation for publish to "{S.admin("planner")}"'])
        assert p0.is_connected  # a refused publish does not cost the connection
    finally:
        await observer.close()


async def test_a_worker_cannot_listen_to_another_workers_commands(connect) -> None:  # type: ignore[no-untyped-def]
    p0 = await connect("worker-p0")
    await _listen(p0, S.worker_control("p1"), AdminCommand)
    await _settle(p0, refused=(p0, 1))
    assert any("permissions violation for subscription" in e for e in p0.permission_errors), p0.permission_errors


@pytest.mark.parametrize("user", ["gateway", "monitor", "planner", "migrator", "worker-d0"])
async def test_only_the_admin_publishes_admin_subjects(user: str, connect) -> None:  # type: ignore[no-untyped-def]
    admin, other = await connect("admin"), await connect(user)
    target = await connect("monitor")
    verbs: list[str] = []

    async def status(cmd: AdminCommand) -> AdminReply:
        verbs.append(cmd.verb)
        return AdminReply(ok=True, message="monitor here")

    await target.serve(S.admin("monitor"), AdminCommand, status, error_reply=lambda m: AdminReply(ok=False, message=m))
    await target.nc.flush()
    reply = await _request_until_served(admin, S.admin("monitor"))  # the admin may
    assert reply.message == "monitor here"  # ... and the monitor, which may publish nothing, may answer it
    await other.publish(S.admin("monitor"), AdminCommand(verb="status"))
    await _settle(other, target, refused=(other, 1))
    assert verbs == ["status"]
    assert other.permission_errors == [f'nats: permissions violation for publish to "{S.admin("monitor")}"']


async def _request_until_served(bus: Bus, subject: str, timeout_s: float = 20.0) -> AdminReply:
    """A status request, again while no responder is there yet (a subscription made on another connection
    reaches the server's interest graph on its own time on a busy box)."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return await bus.request(subject, AdminCommand(verb="status"), AdminReply, timeout_s=5)
        except BusTimeout:  # "no service answers": the subscription is not there yet
            if time.monotonic() > deadline:
                raise
            await asyncio.sleep(0.05)


async def test_the_planner_commands_workers_and_the_migrator_on_their_control_subjects(connect) -> None:  # type: ignore[no-untyped-def]
    planner, worker, migrator = await connect("planner"), await connect("worker-p2"), await connect("migrator")

    def answer(who: str) -> Callable[[AdminCommand], object]:
        async def handler(cmd: AdminCommand) -> AdminReply:
            return AdminReply(ok=True, message=f"{who}: {cmd.verb}")
        return handler

    error = lambda m: AdminReply(ok=False, message=m)  # noqa: E731
    await worker.serve(S.worker_control("p2"), AdminCommand, answer("p2"), error_reply=error)  # type: ignore[arg-type]
    await migrator.serve(S.control("migrator"), AdminCommand, answer("migrator"), error_reply=error)  # type: ignore[arg-type]
    await _settle(worker, migrator)
    assert (await planner.request(S.worker_control("p2"), AdminCommand(verb="retire"), AdminReply)).message == "p2: retire"
    assert (await planner.request(S.control("migrator"), AdminCommand(verb="evacuate"), AdminReply)).message == \
        "migrator: evacuate"
    assert planner.permission_errors == worker.permission_errors == migrator.permission_errors == []
    # The migrator may not command workers, nor the gateway publish a planner event.
    await migrator.publish(S.worker_control("p2"), AdminCommand(verb="retire"))
    await _settle(migrator, refused=(migrator, 1))
    assert migrator.permission_errors == [f'nats: permissions violation for publish to "{S.worker_control("p2")}"']


async def test_wrong_or_missing_nats_credentials_cannot_connect(nats_server: NatsServer) -> None:
    t0 = time.monotonic()
    with pytest.raises(PoiseError, match="refused user 'admin'"):
        await Bus(nats_server.plain_url, name="bad", user="admin", password="not-it", connect_timeout_s=20).connect()
    with pytest.raises(PoiseError, match="refused"):
        await Bus(nats_server.plain_url, name="anonymous", connect_timeout_s=20).connect()
    assert time.monotonic() - t0 < 10  # refused at once, not retried until the timeout
    leaked = url_with_credentials(nats_server.plain_url, "admin", "not-it")
    with pytest.raises(PoiseError) as err:
        await Bus(leaked, name="bad-url", connect_timeout_s=20).connect()
    assert "not-it" not in str(err.value) and redact_url(leaked) in str(err.value)  # no password in messages


async def test_the_nats_config_file_holds_hashes_not_passwords(nats_server: NatsServer) -> None:
    """Reading nats-server's config gives no credential, and the hash in it still lets the right password in."""
    config = nats_server.config_file
    assert config is not None
    text = config.read_text()
    assert all(u.password not in text for u in nats_server.users.values()) and "$2b$" in text
    bus = Bus(nats_server.url_for("admin"), name="admin-by-hash", connect_timeout_s=20)
    await bus.connect()
    await bus.close()


# -- etcd --------------------------------------------------------------------------------------------------------
async def test_etcd_refuses_clients_without_the_right_credentials(etcd_server: EtcdServer) -> None:
    keys = Keys("authz")
    with pytest.raises(PoiseError, match="refused access without credentials"):
        await Registry(etcd_server.plain_url, keys, connect_timeout_s=10).connect()
    with pytest.raises(PoiseError, match="refused access as 'poise'"):
        await Registry(etcd_server.plain_url, keys, user="poise", password="not-it", connect_timeout_s=10).connect()
    registry = Registry(etcd_server.url, keys)  # the poise user: /poise/ only
    await registry.connect()
    try:
        await registry.client.put(keys.planner_paused().encode(), b"x")
        await registry.client.delete(keys.planner_paused().encode())
        with pytest.raises(aetcd.exceptions.ClientError, match="permission denied"):
            await registry.client.put(b"/elsewhere", b"x")
    finally:
        await registry.close()


async def test_a_sidecars_etcd_user_writes_its_own_instance_key_only(tmp_path: Path) -> None:
    """One worker's credentials cannot register a fake instance or overwrite another's (a fake instance would
    be sent requests), nor pause the planner; they do register, refresh and remove their own."""
    keys = Keys("mine")
    creds = Credentials.generate([], etcd_workers=["d0"])
    etcd = EtcdServer(tmp_path, auth=EtcdAuth.of(creds, keys.instance), bcrypt_cost=4)
    user, password = creds.etcd_login("d0")
    assert user == "worker-d0"
    worker = Registry(etcd.plain_url, keys, user=user, password=password, connect_timeout_s=10)
    await worker.connect()
    try:
        own = InstanceRegistration(worker, ttl_s=3)
        await own.register(_info("d0"))
        await own.update(_info("d0"))
        instances, _ = await worker.list_instances()  # it may read the namespace
        assert set(instances) == {"d0"}
        for key in (keys.instance("d1"), keys.planner_paused(), "/poise/other/instances/d0"):
            with pytest.raises(aetcd.exceptions.ClientError, match="permission denied"):
                await worker.client.put(key.encode(), b"{}")
        fake = InstanceRegistration(worker, ttl_s=3)
        with pytest.raises(aetcd.exceptions.ClientError, match="permission denied"):
            await fake.register(_info("d9"))
        await own.deregister()
        assert (await worker.list_instances())[0] == {}
    finally:
        await worker.close()
        etcd.stop()


def _info(instance_id: str) -> InstanceInfo:
    return InstanceInfo(instance_id=instance_id, role="decode", engine_kind="sim", url="http://127.0.0.1:1",
                        bootstrap_host="127.0.0.1", bootstrap_port=None, model="m", profile="p",
                        kv_capacity_tokens=1, max_running_requests=1, sidecar="t", registered_at_unix_s=time.time())


async def test_clients_log_in_again_after_etcd_restarts(tmp_path: Path) -> None:
    """etcd forgets its auth tokens when it restarts: registration and the instance mirror must log in again."""
    auth = EtcdAuth.generate()
    etcd = EtcdServer(tmp_path, auth=auth, bcrypt_cost=4)
    keys = Keys("relogin")
    owner, observer = Registry(etcd.url, keys), Registry(etcd.url, keys)
    await owner.connect()
    await observer.connect()
    watcher = InstanceWatcher(observer)
    await watcher.start()
    registration = InstanceRegistration(owner, ttl_s=3)
    late = InstanceRegistration(owner, ttl_s=3)
    try:
        await registration.register(_info("d0"))
        await until(lambda: "d0" in watcher.instances, 20)
        etcd.stop()
        await until(lambda: not watcher.watching, 20)
        etcd = EtcdServer(tmp_path, port=etcd.port, auth=auth, bcrypt_cost=4)
        deadline = time.monotonic() + 20
        while True:
            try:
                await late.register(_info("d1"))
                break
            except Exception:
                if time.monotonic() > deadline:
                    raise
                await asyncio.sleep(0.2)
        await until(lambda: {"d0", "d1"} <= set(watcher.instances), 20)
    finally:
        await watcher.stop()
        await late.deregister()
        await registration.deregister()
        await owner.close()
        await observer.close()
        etcd.stop()


# -- the planner's local connector: the engines it starts get their own users -------------------------------
@pytest.mark.skipif(importlib.util.find_spec("services.engine_sim.__main__") is None, reason="no engine_sim")
async def test_a_worker_the_local_connector_starts_runs_as_its_own_user(
        connect, nats_server: NatsServer, nats_credentials: Credentials, etcd_server: EtcdServer,  # type: ignore[no-untyped-def]
        tmp_path: Path) -> None:
    assert etcd_server.auth is not None
    spares = tmp_path / "worker-credentials.json"
    Credentials(nats={"worker-p2": nats_credentials.nats_password("worker-p2")}, etcd_user=etcd_server.auth.user,
                etcd_password=etcd_server.auth.password).write(spares)
    planner = await connect("planner")  # the connector commands workers on the planner's bus
    observer = await connect("admin")
    loads = await _listen(observer, S.load("p2"))
    registry = Registry(etcd_server.url, Keys(AUTHZ_NAMESPACE))
    await registry.connect()
    watcher = InstanceWatcher(registry)
    await watcher.start()
    settings = LocalConnectorSettings(namespace=AUTHZ_NAMESPACE, nats_url=nats_server.plain_url,
                                      etcd_url=etcd_server.plain_url, worker_credentials_file=spares, time_scale=0.0,
                                      log_dir=tmp_path, worker_args=["--load-interval-s", "0.1"])
    connector = LocalConnector(settings, bus=planner, existing_ids=lambda: {"p0", "p1"})
    try:
        assert await connector.start("prefill") == "p2"
        await until(lambda: "p2" in watcher.instances and bool(loads), 30)  # registered in etcd, loads on NATS
        with pytest.raises(ConnectorError, match="no NATS user for worker p3"):
            await connector.start("prefill")  # no spare user for it: refused before anything starts
        await connector.retire("p2", drain_timeout_s=5)  # over worker.p2.control, as the planner
        await until(lambda: "p2" not in watcher.instances, 20)
        log = (tmp_path / "worker-p2.log").read_text()
        assert "permissions violation" not in log and "nats_password" not in log.lower()
        assert planner.permission_errors == []
    finally:
        await connector.close()
        await watcher.stop()
        await registry.close()
