"""The NATS and etcd adapters against the real servers."""

from __future__ import annotations

import functools
import time
import uuid

import pytest

from shared.bus import Bus
from shared.devservers import EtcdServer, NatsServer
from shared.errors import BusTimeout
from shared.protocol import AdminCommand, AdminReply, InstanceInfo, Keys, LoadReport, Subjects
from shared.registry import InstanceRegistration, InstanceWatcher, LeaderElection, Registry
from tests.integration.waiting import until

pytestmark = pytest.mark.asyncio


def _info(instance_id: str, role: str = "prefill") -> InstanceInfo:
    return InstanceInfo(
        instance_id=instance_id, role=role, engine_kind="sim", url="http://127.0.0.1:1", bootstrap_host="127.0.0.1",
        bootstrap_port=2, model="m", profile="p", kv_capacity_tokens=100, max_running_requests=8, sidecar="t",
        registered_at_unix_s=time.time(),
    )


_until = functools.partial(until, timeout_s=10.0)


async def test_publish_subscribe_drops_bad_messages(nats_server: NatsServer) -> None:
    subjects = Subjects(f"t{uuid.uuid4().hex[:8]}")
    bus = Bus(nats_server.url, name="test")
    await bus.connect()
    got: list[LoadReport] = []

    async def on_load(msg: LoadReport, subject: str) -> None:
        got.append(msg)

    await bus.subscribe(subjects.load_all(), LoadReport, on_load)
    await bus.nc.publish(subjects.load("x"), b"not json")  # must be dropped, not crash the subscriber
    await bus.publish(subjects.load("x"), LoadReport(instance_id="x", role="decode", status="ready", ts_unix_s=1.0))
    await _until(lambda: len(got) == 1)
    assert got[0].instance_id == "x"
    assert bus.dropped_messages == 1
    await bus.close()


async def test_request_reply_and_timeout(nats_server: NatsServer) -> None:
    subjects = Subjects(f"t{uuid.uuid4().hex[:8]}")
    bus = Bus(nats_server.url, name="test")
    await bus.connect()

    async def handle(cmd: AdminCommand) -> AdminReply:
        if cmd.verb == "boom":
            raise RuntimeError("kaput")
        return AdminReply(ok=True, message=cmd.verb)

    await bus.serve(subjects.admin("svc"), AdminCommand, handle, error_reply=lambda m: AdminReply(ok=False, message=m))
    reply = await bus.request(subjects.admin("svc"), AdminCommand(verb="status"), AdminReply)
    assert reply.ok and reply.message == "status"
    reply = await bus.request(subjects.admin("svc"), AdminCommand(verb="boom"), AdminReply)
    assert not reply.ok and "kaput" in reply.message
    with pytest.raises(BusTimeout):
        await bus.request(subjects.admin("nobody"), AdminCommand(verb="status"), AdminReply, timeout_s=0.3)
    await bus.close()


async def test_registration_watch_and_lease_expiry(etcd_server: EtcdServer) -> None:
    keys = Keys(f"t{uuid.uuid4().hex[:8]}")
    reg_a, reg_w = Registry(etcd_server.url, keys), Registry(etcd_server.url, keys)
    await reg_a.connect()
    await reg_w.connect()
    watcher = InstanceWatcher(reg_w)
    await watcher.start()
    assert watcher.instances == {}

    registration = InstanceRegistration(reg_a, ttl_s=2)
    await registration.register(_info("p0"))
    await _until(lambda: "p0" in watcher.instances)
    await registration.update(_info("p0", role="decode"))
    await _until(lambda: watcher.instances["p0"].role == "decode")
    await registration.deregister()
    await _until(lambda: "p0" not in watcher.instances)

    # A registrant that dies without deregistering disappears when its lease runs out.
    dead = Registry(etcd_server.url, keys)
    await dead.connect()
    lease = await dead.client.lease(1)
    await dead.client.put(keys.instance("gone").encode(), b'{"schema":"x"}', lease=lease)  # malformed: ignored
    await dead.client.put(keys.instance("p1").encode(), __import__("shared.protocol", fromlist=["encode"]).encode(_info("p1")), lease=lease)
    await _until(lambda: "p1" in watcher.instances)
    assert "gone" not in watcher.instances
    await dead.close()
    await _until(lambda: "p1" not in watcher.instances, timeout_s=10)
    await watcher.stop()
    await reg_a.close()
    await reg_w.close()


async def test_leader_election_fails_over(etcd_server: EtcdServer) -> None:
    keys = Keys(f"t{uuid.uuid4().hex[:8]}")
    regs = [Registry(etcd_server.url, keys) for _ in range(2)]
    for r in regs:
        await r.connect()
    a = LeaderElection(regs[0], "planner", "a", ttl_s=2)
    b = LeaderElection(regs[1], "planner", "b", ttl_s=2)
    await a.start()
    await _until(lambda: a.is_leader)
    await b.start()
    await _until(lambda: b.rounds >= 2)  # b tried, and tried again, while a leads
    assert a.is_leader and not b.is_leader
    await a.stop()
    await _until(lambda: b.is_leader, timeout_s=5)
    assert await b.current_leader() == "b"
    await b.stop()
    for r in regs:
        await r.close()
