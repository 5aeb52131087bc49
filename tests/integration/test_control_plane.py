"""Monitor, planner and migrator in-process against the real nats-server and etcd."""

from __future__ import annotations

import asyncio
import functools
import os
import signal
import threading
import time
import uuid

import httpx
import pytest

from services.migrator.config import MigratorSettings
from services.migrator.service import MigratorService
from services.monitor.config import MonitorSettings
from services.monitor.service import MonitorService
from services.planner.config import PlannerSettings
from services.planner.service import PlannerService
from shared.bus import Bus
from shared.devservers import EtcdServer, NatsServer, free_port
from shared.policies.pools import PoolDecision, RoleChange, StaticPools
from shared.policies.report import PolicyReport
from shared.protocol import (
    AdminCommand,
    AdminReply,
    ClusterSnapshot,
    InstanceInfo,
    Keys,
    LoadReport,
    PlannerEvent,
    RequestEvent,
    RequestEventBatch,
    RoleCommand,
    RoleCommandReply,
    SnapshotReply,
    SnapshotRequest,
    Subjects,
)
from shared.registry import InstanceRegistration, Registry
from shared.runtime import run_service
from shared.settings import load_settings
from tests.integration.waiting import until

pytestmark = pytest.mark.asyncio


_until = functools.partial(until, timeout_s=10.0)


def _info(instance_id: str, role: str) -> InstanceInfo:
    return InstanceInfo(instance_id=instance_id, role=role, engine_kind="sim", url="http://127.0.0.1:1",  # type: ignore[arg-type]
                        bootstrap_host="127.0.0.1", bootstrap_port=9000, model="m", profile="p",
                        kv_capacity_tokens=1000, max_running_requests=8, sidecar="test:1",
                        registered_at_unix_s=time.time())


def _common(nats: NatsServer, etcd: EtcdServer, ns: str) -> dict[str, object]:
    return {"namespace": ns, "nats_url": nats.url, "etcd_url": etcd.url}


async def test_monitor_snapshot_series_and_metrics(nats_server: NatsServer, etcd_server: EtcdServer) -> None:
    ns = f"t{uuid.uuid4().hex[:8]}"
    subjects = Subjects(ns)
    port = free_port()
    monitor = MonitorService(load_settings(MonitorSettings, http_port=port, series_interval_s=60.0,
                                           **_common(nats_server, etcd_server, ns)))
    registry = Registry(etcd_server.url, Keys(ns))
    await registry.connect()
    registration = InstanceRegistration(registry, ttl_s=2)
    bus = Bus(nats_server.url, name="test")
    await bus.connect()
    async with monitor:
        await registration.register(_info("p0", "prefill"))
        await _until(lambda: "p0" in monitor.instances)
        await bus.publish(subjects.load("p0"), LoadReport(instance_id="p0", role="prefill", status="ready",
                                                          ts_unix_s=time.time(), num_running_reqs=3, num_waiting_reqs=2,
                                                          token_usage=0.25))
        await bus.publish(subjects.load("ghost"), LoadReport(instance_id="ghost", role="decode", status="ready",
                                                             ts_unix_s=time.time()))
        events = [RequestEvent(
            rid=f"r{i}", model="m", arrived_unix_s=time.time(), finished_unix_s=time.time(), prefill_id="p0",
            decode_id="d0", input_tokens=100, output_tokens=20, ttft_s=0.2, tpot_s=0.01,
            status="ok" if i else "error") for i in range(4)]
        await bus.publish(subjects.request_events(), RequestEventBatch(gateway="g", events=events[:1]))
        await bus.publish(subjects.request_events(), RequestEventBatch(gateway="g", events=events[1:]))
        # The planner's events become the dashboards' flips, target split and forecast.
        for event in (PlannerEvent(kind="flip_done", ts_unix_s=time.time(), replica_id="a", to_role="decode"),
                      PlannerEvent(kind="flip_failed", ts_unix_s=time.time(), replica_id="a", to_role="prefill"),
                      PlannerEvent(kind="resize_requested", ts_unix_s=time.time(), replica_id="a", target_prefill=3,
                                   target_decode=5),
                      PlannerEvent(kind="forecast", ts_unix_s=time.time(), replica_id="a", forecast_rate_rps=4.5,
                                   forecast_isl=1020.0, forecast_osl=250.0, forecast_concurrency=12.0,
                                   forecast_ratio=0.6)):
            await bus.publish(subjects.planner_events(), event)
        await _until(lambda: monitor.counters.load_reports == 2 and monitor.counters.events == 4
                     and bool(monitor.planner.forecast))
        monitor.roll()

        reply = await bus.request(subjects.monitor_snapshot(), SnapshotRequest(series_points=10), SnapshotReply)
        assert reply.ok and reply.snapshot is not None
        snap: ClusterSnapshot = reply.snapshot
        assert [i.info.instance_id for i in snap.instances] == ["p0"]  # the unregistered ghost is left out
        inst = snap.instances[0]
        assert inst.load is not None and inst.load.num_running_reqs == 3
        assert inst.load_age_s is not None and 0 <= inst.load_age_s < 5
        assert len(snap.series) == 1 and snap.series[0].arrivals == 4 and snap.series[0].completed == 3
        assert snap.series[0].mean_running_reqs == 3.0
        no_series = await bus.request(subjects.monitor_snapshot(), SnapshotRequest(series_points=0), SnapshotReply)
        assert no_series.snapshot is not None and no_series.snapshot.series == []

        status = await bus.request(subjects.admin("monitor"), AdminCommand(verb="status"), AdminReply)
        assert status.ok and status.status is not None and status.status.details["instances"] == 1
        unknown = await bus.request(subjects.admin("monitor"), AdminCommand(verb="frobnicate"), AdminReply)
        assert not unknown.ok and "status" in unknown.message

        async with httpx.AsyncClient(trust_env=False) as http:
            text = (await http.get(f"http://127.0.0.1:{port}/metrics")).text
            assert 'poise_instance_running_reqs{instance="p0",role="prefill"} 3.0' in text
            assert 'poise_instance_waiting_reqs{instance="p0",role="prefill"} 2.0' in text
            assert 'poise_instance_token_usage{instance="p0",role="prefill"} 0.25' in text
            assert 'poise_cluster_instances{role="prefill"} 1.0' in text
            assert 'poise_requests_total{status="ok"} 3.0' in text
            assert "poise_arrival_rate_rps" in text and "ghost" not in text
            assert 'poise_planner_flips_total{outcome="done",to_role="decode"} 1.0' in text
            assert 'poise_planner_flips_total{outcome="failed",to_role="prefill"} 1.0' in text
            assert 'poise_planner_target_instances{role="decode"} 5.0' in text
            assert 'poise_planner_forecast{quantity="rate_rps"} 4.5' in text
            assert 'poise_planner_forecast{quantity="ratio"} 0.6' in text
            assert "poise_mean_input_tokens 100.0" in text
            assert (await http.get(f"http://127.0.0.1:{port}/healthz")).json()["instances"] == 1

        await registration.deregister()
        await _until(lambda: "p0" not in monitor.instances)
        reply = await bus.request(subjects.monitor_snapshot(), SnapshotRequest(), SnapshotReply)
        assert reply.snapshot is not None and reply.snapshot.instances == []
    await bus.close()
    await registry.close()


class _OneFlip:
    """A pool policy that asks for one role change, once (what an adaptive policy will return)."""

    name = "one-flip"
    note = "test: flips p0 to decode once"
    interval_s = 0.1

    def __init__(self) -> None:
        self.snapshots: list[ClusterSnapshot] = []

    def decide(self, snapshot: ClusterSnapshot, now_s: float) -> PoolDecision | None:
        self.snapshots.append(snapshot)
        if len(self.snapshots) == 1:
            return PoolDecision(changes=[RoleChange(instance_id="p0", new_role="decode", reason="test flip")])
        return None

    def report(self) -> PolicyReport:
        return PolicyReport()


async def test_planner_and_migrator_lead_and_act(nats_server: NatsServer, etcd_server: EtcdServer) -> None:
    ns = f"t{uuid.uuid4().hex[:8]}"
    subjects = Subjects(ns)
    common = _common(nats_server, etcd_server, ns)
    registry = Registry(etcd_server.url, Keys(ns))
    await registry.connect()
    registration = InstanceRegistration(registry, ttl_s=2)
    await registration.register(_info("p0", "prefill"))
    bus = Bus(nats_server.url, name="test")
    await bus.connect()
    commands: list[RoleCommand] = []

    async def fake_sidecar(cmd: RoleCommand) -> RoleCommandReply:  # stands in for the worker of p0
        commands.append(cmd)
        return RoleCommandReply(command_id=cmd.command_id, instance_id="p0", ok=True, message="switched",
                                old_role="prefill", new_role=cmd.new_role)

    await bus.serve(subjects.worker_command("p0"), RoleCommand, fake_sidecar,
                    error_reply=lambda m: RoleCommandReply(command_id="", instance_id="p0", ok=False, message=m,
                                                           old_role="prefill", new_role="prefill"))
    monitor = MonitorService(load_settings(MonitorSettings, http_port=0, **common))
    policy = _OneFlip()
    planner = PlannerService(load_settings(PlannerSettings, tick_interval_s=0.1, leader_ttl_s=2, replica_id="a", **common),
                             policy=policy)
    migrator = MigratorService(load_settings(MigratorSettings, tick_interval_s=0.1, leader_ttl_s=2, **common))
    async with monitor, planner, migrator:
        await _until(lambda: planner.is_leader and migrator.is_leader)
        # The leader's tick fetched a snapshot with the registered instance and carried out the policy's change.
        await _until(lambda: len(commands) == 1 and len(policy.snapshots) >= 2)
        assert [i.info.instance_id for i in policy.snapshots[0].instances] == ["p0"]
        assert commands[0].new_role == "decode" and commands[0].reason == "test flip"
        await _until(lambda: bool(planner.recent))
        assert planner.recent[-1]["ok"] is True

        reply = await bus.request(subjects.admin("planner"), AdminCommand(verb="status"), AdminReply)
        assert reply.ok and reply.status is not None
        assert reply.status.is_leader and reply.status.policy == "one-flip" and reply.status.replica_id == "a"
        reply = await bus.request(subjects.admin("migrator"), AdminCommand(verb="status"), AdminReply)
        assert reply.ok and reply.status is not None and reply.status.is_leader
        assert reply.status.policy == "none" and "no decode-to-decode migration" in reply.status.policy_note
        await _until(lambda: migrator.loop_details()["ticks"] > 0)
        assert migrator.loop_details()["tick_errors"] == 0

        # poise admin set-role goes through the planner to the sidecar.
        reply = await bus.request(subjects.admin("planner"),
                                  AdminCommand(verb="set-role", args={"instance": "p0", "role": "prefill"}),
                                  AdminReply, timeout_s=5)
        assert reply.ok and "switched" in reply.message and commands[-1].new_role == "prefill"
        reply = await bus.request(subjects.admin("planner"),
                                  AdminCommand(verb="set-role", args={"instance": "nobody", "role": "decode"}),
                                  AdminReply, timeout_s=5)
        assert not reply.ok and "no instance 'nobody' is registered" in reply.message
        reply = await bus.request(subjects.admin("planner"), AdminCommand(verb="set-role", args={"instance": "p0"}),
                                  AdminReply, timeout_s=5)
        assert not reply.ok and "missing argument 'role'" in reply.message
    await registration.deregister()
    await bus.close()
    await registry.close()


async def test_static_planner_status_and_one_leader_of_two(nats_server: NatsServer, etcd_server: EtcdServer) -> None:
    ns = f"t{uuid.uuid4().hex[:8]}"
    subjects = Subjects(ns)
    common = _common(nats_server, etcd_server, ns)
    bus = Bus(nats_server.url, name="test")
    await bus.connect()
    monitor = MonitorService(load_settings(MonitorSettings, http_port=0, **common))
    a = PlannerService(load_settings(PlannerSettings, tick_interval_s=0.1, leader_ttl_s=2, replica_id="a", **common))
    b = PlannerService(load_settings(PlannerSettings, tick_interval_s=0.1, leader_ttl_s=2, replica_id="b", **common))
    async with monitor:
        await a.start()
        await _until(lambda: a.is_leader)
        await b.start()
        await _until(lambda: b.loop_details()["election_rounds"] >= 1)  # b ran for leader and lost
        assert a.is_leader and not b.is_leader
        replies = [await bus.request(subjects.admin("planner"), AdminCommand(verb="status"), AdminReply) for _ in range(6)]
        seen = {r.status.replica_id: r.status.is_leader for r in replies if r.status is not None}
        assert seen.get("a", True) is True and seen.get("b", False) is False
        status = replies[0].status
        assert status is not None and status.policy == "static"
        assert status.policy_note == StaticPools.note
        await _until(lambda: a.loop_details()["ticks"] > 0)
        assert a.loop_details()["tick_errors"] == 0 and a.last_decision is not None and a.last_decision.changes == []
        await a.stop()
        await _until(lambda: b.is_leader, timeout_s=5)  # a revoked its lease: b takes over within a round
        await b.stop()
    await bus.close()


@pytest.mark.skipif(threading.current_thread() is not threading.main_thread(), reason="signals need the main thread")
async def test_run_service_stops_on_sigterm(nats_server: NatsServer, etcd_server: EtcdServer) -> None:
    ns = f"t{uuid.uuid4().hex[:8]}"
    monitor = MonitorService(load_settings(MonitorSettings, http_port=0, **_common(nats_server, etcd_server, ns)))
    task = asyncio.create_task(run_service(monitor))
    bus = Bus(nats_server.url, name="test")
    await bus.connect()
    deadline = time.monotonic() + 10
    while True:  # wait until the monitor answers
        try:
            await bus.request(Subjects(ns).admin("monitor"), AdminCommand(verb="status"), AdminReply, timeout_s=0.3)
            break
        except Exception:
            assert time.monotonic() < deadline
            await asyncio.sleep(0.05)
    os.kill(os.getpid(), signal.SIGTERM)  # handled by run_service's loop handler, not the default action
    assert await asyncio.wait_for(task, 10) == 0
    assert signal.getsignal(signal.SIGTERM) is not None
    await monitor.stop()  # a second stop is a no-op
    await bus.close()


class _SlowStart:
    """A service whose start never finishes by itself (an engine that is still loading)."""

    name = "slow"

    def __init__(self) -> None:
        self.started = asyncio.Event()
        self.stops = 0

    async def start(self) -> None:
        self.started.set()
        await asyncio.sleep(3600)

    async def stop(self) -> None:
        self.stops += 1


async def test_run_service_gives_up_a_slow_start_when_asked_to_stop() -> None:
    service = _SlowStart()
    stop = asyncio.Event()
    task = asyncio.create_task(run_service(service, stop_event=stop, signals=()))
    await service.started.wait()
    stop.set()
    assert await asyncio.wait_for(task, 5) == 0
    assert service.stops == 1


class _FailingStart(_SlowStart):
    async def start(self) -> None:
        raise RuntimeError("no engine")


async def test_run_service_reports_a_failed_start() -> None:
    service = _FailingStart()
    assert await asyncio.wait_for(run_service(service, signals=()), 5) == 1
    assert service.stops == 1
