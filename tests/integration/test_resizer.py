"""Live resizing on real NATS and etcd: a scaling target starts engines through the local connector, and a
lower one retires the least loaded engine gracefully (drain, deregister, exit)."""

from __future__ import annotations

import functools
import time
import uuid
from pathlib import Path
from typing import Any

import pytest

from services.planner.connectors import LocalConnector, LocalConnectorSettings
from services.planner.resizer import Resizer
from shared.devservers import EtcdServer, NatsServer
from shared.policies import ScalingTarget
from shared.policies.report import PolicyReport
from shared.protocol import ClusterSnapshot, InstanceLoad
from tests.integration.observer import start_observer
from tests.integration.waiting import until


class Scripted:
    """A scaling policy that wants whatever the test says (the real ones are tested on their own)."""

    name = "scripted"
    note = "test"
    interval_s = 1.0

    def __init__(self) -> None:
        self.target: ScalingTarget | None = None

    def decide(self, snapshot: ClusterSnapshot, now_s: float) -> ScalingTarget | None:
        return self.target

    def report(self) -> PolicyReport:
        return PolicyReport()


_until = functools.partial(until, timeout_s=30.0)


@pytest.mark.asyncio
async def test_targets_start_and_retire_engines(nats_server: NatsServer, etcd_server: EtcdServer,
                                                tmp_path: Path) -> None:
    ns = f"t{uuid.uuid4().hex[:8]}"
    obs = await start_observer(nats_server.url, etcd_server.url, ns, "none")
    events: list[tuple[str, dict[str, Any]]] = []

    async def publish(kind: str, **fields: Any) -> None:
        events.append((kind, fields))

    connector = LocalConnector(LocalConnectorSettings(namespace=ns, nats_url=nats_server.url, etcd_url=etcd_server.url,
                                                      time_scale=0.0, log_dir=tmp_path),
                               existing_ids=lambda: set(obs.watcher.instances))
    policy = Scripted()
    resizer = Resizer(policy, connector, drain_timeout_s=5.0, publish=publish)

    def snapshot() -> ClusterSnapshot:
        return ClusterSnapshot(ts_unix_s=time.time(), series=[], instances=[
            InstanceLoad(info=info, load=None, load_age_s=None) for info in obs.watcher.instances.values()])

    try:
        policy.target = ScalingTarget(prefill=1, decode=2, reason="test: grow")
        await resizer.step(snapshot(), time.time())
        # A second tick before they registered must not start more: the pending starts count.
        await resizer.step(snapshot(), time.time())
        await _until(lambda: len(obs.watcher.instances) == 3)
        roles = sorted(i.role for i in obs.watcher.instances.values())
        assert roles == ["decode", "decode", "prefill"] and len(connector.workers) == 3
        assert events and events[0][0] == "resize_requested" and events[0][1]["target_decode"] == 2

        policy.target = ScalingTarget(prefill=1, decode=1, reason="test: shrink")
        await resizer.step(snapshot(), time.time())
        await _until(lambda: sum(1 for i in obs.watcher.instances.values() if i.role == "decode") == 1)
        await _until(lambda: any(a["action"] == "retire" and a["ok"] for a in resizer.actions))
        retired = next(a["instance"] for a in resizer.actions if a["action"] == "retire")
        assert connector.workers[retired].returncode == 0  # drained and exited by itself
        status = resizer.status()
        assert status["target"]["decode"] == 1 and status["decision_latency"]["decisions"] == 3

        # Never below one of a role, whatever the target says.
        policy.target = ScalingTarget(prefill=0, decode=0, reason="test: nothing")
        await resizer.step(snapshot(), time.time())
        assert resizer.status()["retiring"] == []
    finally:
        await resizer.close()
        await obs.close()
    assert all(w.returncode is not None for w in connector.workers.values())


def test_planner_settings_wire_a_scaling_policy_to_a_connector(tmp_path: Path) -> None:
    from pydantic import ValidationError

    from services.planner.config import PlannerSettings
    from services.planner.resizer import build_connector

    with pytest.raises(ValidationError, match="needs a connector"):
        PlannerSettings(scaling_policy="dopd")
    with pytest.raises(ValidationError, match="unknown scaling policy"):
        PlannerSettings(scaling_policy="hpa", connector="local")
    s = PlannerSettings(scaling_policy="dopd", connector="local", namespace="x", nats_url="nats://h:1",
                        etcd_url="http://h:2", connector_settings={"time_scale": 0.0, "log_dir": str(tmp_path)})
    connector = build_connector(s, bus=None, existing_ids=lambda: {"p3"})  # type: ignore[arg-type]
    assert isinstance(connector, LocalConnector)
    assert connector.settings.etcd_url == "http://h:2" and connector.settings.namespace == "x"
    assert connector.settings.time_scale == 0.0
