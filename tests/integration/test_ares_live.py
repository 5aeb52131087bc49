"""ARES live: the migrator's ARES policy moves requests off an overloaded decode instance by itself.

Real nats-server and etcd; workers (sidecar + engine_sim, predicting remaining lengths with the oracle) p0
(prefill) and d0 (decode); long streams all land on d0; then a second decode instance d1 joins, empty. The
migrator (policy ``ares``, KV copies) must move requests to d1 on its own, and every stream must still equal
its reference run byte for byte.
"""

from __future__ import annotations

import asyncio
import uuid
from pathlib import Path

import httpx
import pytest

from services.migrator.config import MigratorSettings
from services.migrator.service import MigratorService
from services.monitor.config import MonitorSettings
from services.monitor.service import MonitorService
from services.worker.config import WorkerSettings
from services.worker.sidecar import WorkerService
from shared.devservers import EtcdServer, NatsServer
from shared.settings import load_settings
from tests.integration.gateway_harness import run_gateway
from tests.integration.test_gateway_migration import Stream, assert_same, stream
from tests.integration.waiting import until

pytestmark = pytest.mark.asyncio
MODEL = "ares-model"
TIME_SCALE = 4.0  # ~40 ms a decode step: a 400-token answer streams for ~16 s


def bodies() -> list[dict[str, object]]:
    return [{"model": MODEL, "prompt": f"ares live {i} " * 50, "max_tokens": 400, "ignore_eos": True,
             "stream": True, "stream_options": {"include_usage": True}} for i in range(6)]


def worker(name: str, role: str, common: dict[str, object], tmp: Path) -> WorkerService:
    return WorkerService(load_settings(
        WorkerSettings, instance_id=name, role=role, engine_kind="sim", model=MODEL, time_scale=TIME_SCALE,
        load_interval_s=0.1, lease_ttl_s=2, health_timeout_s=30, stop_timeout_s=5, log_dir=tmp,
        extra_args=["--length-predictor", "oracle"], **common))


async def test_ares_moves_requests_to_a_new_empty_decode_instance(nats_server: NatsServer, etcd_server: EtcdServer,
                                                                  tmp_path: Path) -> None:
    ns = f"t{uuid.uuid4().hex[:8]}"
    common: dict[str, object] = {"namespace": ns, "nats_url": nats_server.url, "etcd_url": etcd_server.url}
    first = [worker("p0", "prefill", common, tmp_path), worker("d0", "decode", common, tmp_path)]
    late = worker("d1", "decode", common, tmp_path)
    monitor = MonitorService(load_settings(MonitorSettings, http_port=0, **common))
    migrator = MigratorService(load_settings(MigratorSettings, policy="ares", mechanism="kv-transfer",
                                             tick_interval_s=0.5, leader_ttl_s=2, **common))
    try:
        await asyncio.gather(*(w.start() for w in first))
        async with monitor, run_gateway(nats_server, etcd_server, ns, first_token_timeout_s=15) as (url, gateway):
            await until(lambda: len(gateway.cluster.instances) == 2, 20)
            async with httpx.AsyncClient(timeout=120) as client:
                want = list(await asyncio.gather(*(stream(client, url, b, Stream()) for b in bodies())))
                got = [Stream() for _ in bodies()]
                tasks = [asyncio.create_task(stream(client, url, b, s)) for b, s in zip(bodies(), got, strict=True)]
                await until(lambda: all(s.tokens >= 5 for s in got), 20)
                await late.start()
                async with migrator:
                    await until(lambda: migrator.moved_total >= 2, 30)
                    moves = list(migrator.recent)
                    await asyncio.gather(*tasks)
        ok = [m for m in moves if m["carried_out"]]
        assert ok and all(m["source"] == "d0" and m["target"] == "d1" for m in ok), moves
        assert all(m["mechanism"] == "kv-transfer" for m in ok)
        assert_same(got, want)
    finally:
        await asyncio.gather(*(w.stop() for w in [*first, late]), return_exceptions=True)
