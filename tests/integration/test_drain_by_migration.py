"""The planner drains a decode instance it flips by migration: the flip waits for one re-prefill, not for the
instance's longest answer, and no client stream notices.

Real nats-server and etcd; workers (sidecar + engine_sim) p0 (prefill), d0 and d1 (decode); a monitor, a
migrator and a planner in-process; the gateway in-process. Streams run on both decode instances; ``flip d0
--to prefill`` must finish well before the streams would have, every stream must equal its reference run
byte for byte, and the migrator must have moved d0's requests.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from pathlib import Path

import httpx
import pytest

from services.migrator.config import MigratorSettings
from services.migrator.service import MigratorService
from services.monitor.config import MonitorSettings
from services.monitor.service import MonitorService
from services.planner.config import PlannerSettings
from services.planner.service import PlannerService
from services.worker.config import WorkerSettings
from services.worker.sidecar import WorkerService
from shared.bus import Bus
from shared.devservers import EtcdServer, NatsServer
from shared.protocol import AdminCommand, AdminReply, Subjects
from shared.settings import load_settings
from tests.integration.gateway_harness import run_gateway
from tests.integration.test_gateway_migration import Stream, assert_same, stream
from tests.integration.waiting import until

pytestmark = pytest.mark.asyncio
MODEL = "drain-model"
TIME_SCALE = 4.0  # ~40 ms a decode step: a 300-token answer streams for ~12 s


def bodies() -> list[dict[str, object]]:
    return [{"model": MODEL, "prompt": f"drain test {i} " * 40, "max_tokens": 300, "ignore_eos": True,
             "stream": True, "stream_options": {"include_usage": True}} for i in range(4)]


async def test_flipping_a_decode_instance_moves_its_requests_instead_of_waiting(
        nats_server: NatsServer, etcd_server: EtcdServer, tmp_path: Path) -> None:
    ns = f"t{uuid.uuid4().hex[:8]}"
    common = {"namespace": ns, "nats_url": nats_server.url, "etcd_url": etcd_server.url}
    workers = [WorkerService(load_settings(
        WorkerSettings, instance_id=name, role=role, engine_kind="sim", model=MODEL, time_scale=TIME_SCALE,
        load_interval_s=0.1, lease_ttl_s=2, health_timeout_s=30, stop_timeout_s=5, log_dir=tmp_path, **common))
        for name, role in (("p0", "prefill"), ("d0", "decode"), ("d1", "decode"))]
    monitor = MonitorService(load_settings(MonitorSettings, http_port=0, **common))
    migrator = MigratorService(load_settings(MigratorSettings, leader_ttl_s=2, **common))
    planner = PlannerService(load_settings(PlannerSettings, tick_interval_s=0.5, leader_ttl_s=2, drain_timeout_s=60,
                                           **common))
    bus = Bus(nats_server.url, name="test")
    await bus.connect()
    try:
        await asyncio.gather(*(w.start() for w in workers))
        async with monitor, migrator, planner, run_gateway(nats_server, etcd_server, ns, first_token_timeout_s=15,
                                                           dispatch_policy="round-robin") as (url, gateway):
            await until(lambda: len(gateway.cluster.instances) == 3, 20)
            async with httpx.AsyncClient(timeout=90) as client:
                want = list(await asyncio.gather(*(stream(client, url, b, Stream()) for b in bodies())))
                got = [Stream() for _ in bodies()]
                tasks = [asyncio.create_task(stream(client, url, b, s)) for b, s in zip(bodies(), got, strict=True)]
                await until(lambda: all(s.tokens >= 10 for s in got), 20)
                on_d0 = sum(1 for f in gateway.flows.values() if f.attempt and f.attempt.decode.instance_id == "d0")
                assert on_d0 > 0
                t0 = time.monotonic()
                reply = await bus.request(Subjects(ns).admin("planner"),
                                          AdminCommand(verb="flip", args={"instance": "d0", "role": "prefill"}),
                                          AdminReply, timeout_s=90)
                flip_s = time.monotonic() - t0
                assert reply.ok, reply.message
                streams_left = sum(not t.done() for t in tasks)
                await asyncio.gather(*tasks)
        # The flip did not wait for the answers: they were still streaming (on d1) when it was done.
        assert streams_left > 0 and flip_s < 8.0, (streams_left, flip_s)
        assert migrator.moved_total >= on_d0
        assert_same(got, want)
    finally:
        await bus.close()
        await asyncio.gather(*(w.stop() for w in workers), return_exceptions=True)
