"""The adapters survive their servers restarting: the instance mirror resyncs, the bus reconnects."""

from __future__ import annotations

import asyncio
import functools
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import msgspec
import pytest

from shared.bus import Bus
from shared.devservers import EtcdServer, NatsServer
from shared.protocol import InstanceInfo, Keys, LoadReport, Subjects
from shared.registry import InstanceRegistration, InstanceWatcher, Registry
from tests.integration.gateway_harness import run_gateway
from tests.integration.waiting import until, until_equal

pytestmark = pytest.mark.asyncio


def _info(instance_id: str) -> InstanceInfo:
    return InstanceInfo(instance_id=instance_id, role="decode", engine_kind="sim", url="http://127.0.0.1:1",
                        bootstrap_host="127.0.0.1", bootstrap_port=None, model="m", profile="p",
                        kv_capacity_tokens=1, max_running_requests=1, sidecar="t", registered_at_unix_s=time.time())


_until = functools.partial(until, timeout_s=20.0)


async def test_watcher_and_registration_survive_an_etcd_restart(tmp_path: Path) -> None:
    etcd = EtcdServer(tmp_path)
    keys = Keys("reconnect")
    owner, observer = Registry(etcd.url, keys), Registry(etcd.url, keys)
    await owner.connect()
    await observer.connect()
    watcher = InstanceWatcher(observer)
    await watcher.start()
    registration = InstanceRegistration(owner, ttl_s=3)
    await registration.register(_info("d0"))
    await _until(lambda: "d0" in watcher.instances)

    etcd.stop()
    await _until(lambda: not watcher.watching)
    etcd = EtcdServer(tmp_path, port=etcd.port)  # same data dir and port: the cluster comes back
    try:
        # A new registration after the restart reaches the watcher, and the old one is still (or again) there.
        late = InstanceRegistration(owner, ttl_s=3)
        await _until_ok(lambda: late.register(_info("d1")))
        await _until(lambda: {"d0", "d1"} <= set(watcher.instances))
        await late.deregister()
        await _until(lambda: "d1" not in watcher.instances)
    finally:
        await watcher.stop()
        await registration.deregister()
        await owner.close()
        await observer.close()
        etcd.stop()


async def _until_ok(action: Callable[[], object], timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            await action()  # type: ignore[misc]
            return
        except Exception:
            if time.monotonic() > deadline:
                raise
            await asyncio.sleep(0.2)


async def test_bus_reconnects_after_a_nats_restart(tmp_path: Path) -> None:
    nats = NatsServer(tmp_path, jetstream=False)
    subjects = Subjects("reconnect")
    sub_bus, pub_bus = Bus(nats.url, name="sub"), Bus(nats.url, name="pub")
    await sub_bus.connect()
    await pub_bus.connect()
    got: list[str] = []

    async def on_load(msg: LoadReport, subject: str) -> None:
        got.append(msg.instance_id)

    await sub_bus.subscribe(subjects.load_all(), LoadReport, on_load)
    nats.stop()
    await _until(lambda: not sub_bus.is_connected)
    nats = NatsServer(tmp_path, port=nats.port, jetstream=False)
    try:
        # Publish until the resubscribed subscriber hears one (both clients reconnect on their own).
        deadline = time.monotonic() + 20
        while not got:
            assert time.monotonic() < deadline, "no message after the restart"
            if pub_bus.is_connected:
                await pub_bus.publish(subjects.load("x"), LoadReport(instance_id="x", role="decode", status="ready",
                                                                     ts_unix_s=time.time()))
            await asyncio.sleep(0.2)
        assert got[0] == "x"
    finally:
        await sub_bus.close()
        await pub_bus.close()
        nats.stop()


async def test_gateway_health_says_degraded_while_the_control_plane_is_down(tmp_path: Path) -> None:
    """Serving from its last view while NATS or etcd is down: 200 "degraded", not 503; back to "ok" after."""
    nats, etcd = NatsServer(tmp_path / "nats", jetstream=False), EtcdServer(tmp_path / "etcd")
    registry = Registry(etcd.url, Keys("health"))
    await registry.connect()
    registrations = [InstanceRegistration(registry, ttl_s=30) for _ in range(2)]
    try:
        async with run_gateway(nats, etcd, "health") as (url, service), httpx.AsyncClient(timeout=5) as client:
            async def health() -> tuple[int, str]:
                r = await client.get(url + "/health")
                return r.status_code, r.json()["status"]

            assert await health() == (503, "unavailable")  # no engine yet: a load balancer must not send here
            await registrations[0].register(msgspec.structs.replace(_info("d0"), role="decode", model="m"))
            await registrations[1].register(msgspec.structs.replace(_info("p0"), role="prefill", model="m"))
            await until_equal(health, (200, "ok"))
            nats.stop()
            await until_equal(health, (200, "degraded"))
            nats = NatsServer(tmp_path / "nats", port=nats.port, jetstream=False)
            await until_equal(health, (200, "ok"))
            etcd.stop()
            await until_equal(health, (200, "degraded"))
            etcd = EtcdServer(tmp_path / "etcd", port=etcd.port)
            await until_equal(health, (200, "ok"))
    finally:
        await registry.close()
        nats.stop()
        etcd.stop()

