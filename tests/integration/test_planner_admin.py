"""The planner's admin verbs and events against real nats-server, etcd and a worker running engine_sim:
pause/resume (shared by the replicas through etcd), pools, flip (with its events and the re-registration
in the new role), the `poise admin` commands, and decisions that run off the event loop."""

from __future__ import annotations

import asyncio
import functools
import json
import sys
import threading
import time
import uuid
from pathlib import Path

import msgspec
import pytest

from services.monitor.config import MonitorSettings
from services.monitor.service import MonitorService
from services.planner.config import PlannerSettings
from services.planner.service import PlannerService
from services.worker.config import WorkerSettings
from services.worker.sidecar import WorkerService
from shared.bus import Bus
from shared.devservers import EtcdServer, NatsServer
from shared.policies import PoolDecision
from shared.policies.report import PolicyReport
from shared.protocol import AdminCommand, AdminReply, ClusterSnapshot, Keys, PlannerEvent, Subjects
from shared.registry import InstanceRegistration, Registry
from shared.settings import load_settings
from tests.integration.waiting import until

pytestmark = pytest.mark.asyncio


_until = functools.partial(until, timeout_s=15.0)


class _SlowCounting:
    """A pool policy that never flips, counts its calls and takes ``sleep_s`` per decision (an ARIMA fit)."""

    name = "slow-counting"
    note = "test: no flips, slow decisions"
    interval_s = 0.1

    def __init__(self, sleep_s: float) -> None:
        self.sleep_s = sleep_s
        self.calls = 0
        self.threads: set[str] = set()
        self.inside = threading.Event()

    def decide(self, snapshot: ClusterSnapshot, now_s: float) -> PoolDecision | None:
        self.calls += 1
        self.threads.add(threading.current_thread().name)
        self.inside.set()
        time.sleep(self.sleep_s)
        self.inside.clear()
        return PoolDecision()

    def report(self) -> PolicyReport:
        return PolicyReport()


async def _spawn_admin(*args: str, nats_url: str, ns: str) -> asyncio.subprocess.Process:
    """`poise admin ...` as a subprocess, without blocking this loop (the services run in it)."""
    return await asyncio.create_subprocess_exec(
        sys.executable, "-m", "services.cli", "admin", "--nats-url", nats_url, "--namespace", ns, *args,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)


async def _finish(proc: asyncio.subprocess.Process, timeout_s: float = 60.0, err_head: bytes = b"") -> tuple[int, str, str]:
    out, err = await asyncio.wait_for(proc.communicate(), timeout_s)
    assert proc.returncode is not None
    return proc.returncode, out.decode(), (err_head + err).decode()


async def _admin(*args: str, nats_url: str, ns: str) -> tuple[int, str, str]:
    return await _finish(await _spawn_admin(*args, nats_url=nats_url, ns=ns))


async def test_pause_resume_pools_flip_and_events(nats_server: NatsServer, etcd_server: EtcdServer,
                                                  tmp_path: Path) -> None:
    ns = f"t{uuid.uuid4().hex[:8]}"
    subjects = Subjects(ns)
    common = {"namespace": ns, "nats_url": nats_server.url, "etcd_url": etcd_server.url}
    bus = Bus(nats_server.url, name="test")
    await bus.connect()
    events: list[PlannerEvent] = []

    async def on_event(event: PlannerEvent, subject: str) -> None:
        events.append(event)

    await bus.subscribe(subjects.planner_events(), PlannerEvent, on_event)
    registry = Registry(etcd_server.url, Keys(ns))
    await registry.connect()

    async def ask(verb: str, timeout_s: float = 5.0, **args: str) -> AdminReply:
        return await bus.request(subjects.admin("planner"), AdminCommand(verb=verb, args=args), AdminReply,
                                 timeout_s=timeout_s)

    worker = WorkerService(load_settings(
        WorkerSettings, instance_id="p0", role="prefill", engine_kind="sim", model="sim-model", time_scale=0.0,
        load_interval_s=0.1, lease_ttl_s=2, health_timeout_s=30, stop_timeout_s=5, log_dir=tmp_path, **common))
    monitor = MonitorService(load_settings(MonitorSettings, http_port=0, **common))
    policy_a, policy_b = _SlowCounting(0.8), _SlowCounting(0.8)
    planner_settings = {"tick_interval_s": 0.1, "leader_ttl_s": 2, **common}
    a = PlannerService(load_settings(PlannerSettings, replica_id="a", **planner_settings), policy=policy_a)
    b = PlannerService(load_settings(PlannerSettings, replica_id="b", **planner_settings), policy=policy_b)
    try:
        await worker.start()
        async with monitor, a:
            await _until(lambda: a.is_leader)
            await b.start()

            # Decisions run on the decider thread: while one is running, the loop still answers admin requests.
            await _until(policy_a.inside.is_set)
            t0 = time.monotonic()
            reply = await ask("status")
            assert reply.ok and time.monotonic() - t0 < 0.4 and policy_a.inside.is_set()
            assert policy_a.threads == {"planner-decide_0"}
            await _until(lambda: a.decider.count >= 2)
            latency = a.service_status().details["decision_latency"]
            assert latency["p50_ms"] >= 750 and latency["p99_ms"] >= latency["p50_ms"]

            # pause: whichever replica takes it, the leader stops deciding (the pause lives in etcd).
            for _ in range(4):
                reply = await ask("pause", reason="maintenance")
                assert reply.ok, reply.message
            assert (await registry.planner_pause()) is not None
            await _until(lambda: a.paused)
            # Ticks run one at a time: two more ticks and a decision started before the pause has finished.
            # After that, ticks go by without a policy call.
            ticks = a.loop_details()["ticks"]
            await _until(lambda: a.loop_details()["ticks"] >= ticks + 2)
            calls, ticks = policy_a.calls, a.loop_details()["ticks"]
            await _until(lambda: a.loop_details()["ticks"] >= ticks + 5)
            assert policy_a.calls == calls and policy_b.calls == 0
            paused = [e for e in events if e.kind == "paused"]
            assert len(paused) == 1 and paused[0].reason == "maintenance" and paused[0].source == "admin"
            for _ in range(6):  # whichever replica answers (a follower does not tick), it reads the pause
                status = (await ask("status")).status
                assert status is not None and status.details["paused"] is True, status.replica_id

            # pools: the registered instance, its role, and the policy
            reply = await ask("pools")
            assert reply.ok and reply.status is not None, reply.message
            rows = reply.status.details["pools"]
            assert [(r["instance_id"], r["role"], r["status"]) for r in rows] == [("p0", "prefill", "ready")]
            assert "1 prefill, 0 decode" in reply.message and "(paused)" in reply.message

            # flip while paused (an operator's manual flip): requested, done with a duration, re-registered.
            before = len(events)
            reply = await ask("flip", timeout_s=60, instance="p0", role="decode")
            assert reply.ok and "prefill -> decode" in reply.message, reply.message
            info = await registry.get_instance("p0")
            assert info is not None and (info.role, info.status) == ("decode", "ready")
            await _until(lambda: len(events) >= before + 2)
            requested, done = events[before], events[before + 1]
            assert requested.kind == "flip_requested" and done.kind == "flip_done"
            for e in (requested, done):
                assert (e.instance_id, e.from_role, e.to_role, e.source) == ("p0", "prefill", "decode", "admin")
            assert requested.command_id == done.command_id and requested.reason == "admin flip"
            assert done.duration_s is not None and 0 < done.duration_s < 30 and requested.duration_s is None
            assert done.ts_unix_s >= requested.ts_unix_s

            # A flip of an id nobody registered is refused at once, naming the ids that are, and sends nothing.
            before = len(events)
            reply = await ask("flip", instance="ghost", role="prefill")
            assert not reply.ok and "no instance 'ghost' is registered (registered: p0)" in reply.message
            # One that is registered but whose sidecar does not answer is reported as flip_failed.
            p0 = await registry.get_instance("p0")
            assert p0 is not None
            ghost = InstanceRegistration(registry, ttl_s=5)
            await ghost.register(msgspec.structs.replace(p0, instance_id="ghost"))
            try:
                reply = await ask("flip", timeout_s=60, instance="ghost", role="prefill")
            finally:
                await ghost.deregister()
            assert not reply.ok
            await _until(lambda: len(events) >= before + 2)
            assert [e.kind for e in events[before:before + 2]] == ["flip_requested", "flip_failed"]
            assert events[before + 1].from_role == "decode" and "no answer" in events[before + 1].message

            # resume: decisions again, and one resumed event.
            reply = await ask("resume")
            assert reply.ok and "resumed" in reply.message
            assert (await registry.planner_pause()) is None
            calls = policy_a.calls
            await _until(lambda: policy_a.calls > calls)
            assert [e.kind for e in events].count("resumed") == 1
            assert not (await ask("resume")).message.startswith("planner resumed")  # a second resume is a no-op
    finally:
        await b.stop()
        await worker.stop()
        await bus.close()
        await registry.close()


async def test_admin_cli_pools_flip_pause_and_events(nats_server: NatsServer, etcd_server: EtcdServer,
                                                    tmp_path: Path) -> None:
    ns = f"t{uuid.uuid4().hex[:8]}"
    common = {"namespace": ns, "nats_url": nats_server.url, "etcd_url": etcd_server.url}
    url = nats_server.url
    worker = WorkerService(load_settings(
        WorkerSettings, instance_id="d0", role="decode", engine_kind="sim", model="sim-model", time_scale=0.0,
        load_interval_s=0.1, lease_ttl_s=2, health_timeout_s=30, stop_timeout_s=5, log_dir=tmp_path, **common))
    monitor = MonitorService(load_settings(MonitorSettings, http_port=0, **common))
    planner = PlannerService(load_settings(PlannerSettings, tick_interval_s=0.2, leader_ttl_s=2, policy="poise",
                                           **common))

    # No planner in this namespace yet: a clear error and a non-zero exit.
    code, out, err = await _admin("flip", "d0", "--to", "prefill", "--wait-s", "1", nats_url=url, ns=ns)
    assert code == 1 and "planner did not answer" in err, (out, err)

    try:
        await worker.start()
        async with monitor, planner:
            await _until(lambda: planner.is_leader)
            listener = await _spawn_admin("events", "--count", "3", "--max-wait-s", "60", "--json", nats_url=url, ns=ns)
            assert listener.stderr is not None
            ready = await asyncio.wait_for(listener.stderr.readline(), 30)  # said once it is subscribed
            assert b"listening on" in ready, ready

            code, out, err = await _admin("planner", "pause", "--reason", "cli test", nats_url=url, ns=ns)
            assert code == 0 and "paused" in out, err
            code, out, err = await _admin("pools", nats_url=url, ns=ns)
            assert code == 0, err
            assert "PAUSED" in out and "d0" in out and "decode" in out and "policy poise" in out
            assert "poise target" in out and "decisions:" in out
            code, out, err = await _admin("flip", "d0", "--to", "prefill", "--reason", "cli", nats_url=url, ns=ns)
            assert code == 0 and "decode -> prefill" in out, (out, err)

            code, out, err = await _finish(listener, err_head=ready)
            assert code == 0, err
            kinds = [json.loads(line)["kind"] for line in out.splitlines()]
            assert kinds == ["paused", "flip_requested", "flip_done"]
            assert json.loads(out.splitlines()[-1])["duration_s"] > 0

            code, out, err = await _admin("pools", "--json", nats_url=url, ns=ns)
            assert code == 0 and json.loads(out)["status"]["details"]["pools"][0]["role"] == "prefill"
            code, out, err = await _admin("planner", "resume", nats_url=url, ns=ns)
            assert code == 0 and "resumed" in out
            code, out, err = await _admin("flip", "d0", "--to", "colocated", nats_url=url, ns=ns)
            assert code == 2 and "invalid choice" in err  # argparse refuses before anything is sent
            # An id nobody registered: refused at once, with the ids that are, and no flip event.
            code, out, err = await _admin("flip", "d9", "--to", "prefill", nats_url=url, ns=ns)
            assert code == 1 and "no instance 'd9' is registered (registered: d0)" in out + err, (out, err)
            assert all(r["instance"] != "d9" for r in planner.recent)
    finally:
        await worker.stop()
