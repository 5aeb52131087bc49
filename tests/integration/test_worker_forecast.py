"""The planner's ISL forecast reaches an engine_sim prefill engine's dopd-length batching through its sidecar.

Real nats-server, etcd, worker sidecar and engine_sim process: a ``forecast`` PlannerEvent published on NATS
sets the engine's forecast (``GET /poise_sim/forecast``); without a newer one the sidecar withdraws it after
``forecast_ttl_s``. A decode engine's sidecar passes nothing on.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from pathlib import Path
from typing import Any

import httpx
import pytest

from services.worker.config import WorkerSettings
from services.worker.sidecar import WorkerService
from shared.bus import Bus
from shared.devservers import EtcdServer, NatsServer
from shared.protocol import Subjects
from shared.protocol.engine_forecast import FORECAST_PATH
from shared.protocol.messages import PlannerEvent
from shared.settings import load_settings

pytestmark = pytest.mark.asyncio


def _worker(instance_id: str, role: str, ns: str, nats: NatsServer, etcd: EtcdServer, tmp: Path) -> WorkerService:
    return WorkerService(load_settings(
        WorkerSettings, instance_id=instance_id, role=role, engine_kind="sim", model="sim-model", time_scale=0.0,
        namespace=ns, nats_url=nats.url, etcd_url=etcd.url, load_interval_s=0.1, lease_ttl_s=2,
        health_timeout_s=30, stop_timeout_s=5, log_dir=tmp, forecast_ttl_s=1.5,
        extra_args=["--prefill-policy", "dopd-length"]))


async def _forecast(http: httpx.AsyncClient, worker: WorkerService) -> dict[str, Any]:
    response = await http.get(f"http://127.0.0.1:{worker.settings.engine_port}{FORECAST_PATH}")
    assert response.status_code == 200
    body: dict[str, Any] = response.json()
    return body


async def _until_forecast(http: httpx.AsyncClient, worker: WorkerService, isl: float | None, timeout_s: float) -> float:
    t0 = time.monotonic()
    while (await _forecast(http, worker))["isl"] != isl:
        assert time.monotonic() - t0 < timeout_s, f"engine forecast never became {isl}"
        await asyncio.sleep(0.05)
    return time.monotonic() - t0


async def test_planner_forecast_reaches_the_prefill_engine_and_expires(nats_server: NatsServer, etcd_server: EtcdServer,
                                                                       tmp_path: Path) -> None:
    ns = f"t{uuid.uuid4().hex[:8]}"
    prefill = _worker("p0", "prefill", ns, nats_server, etcd_server, tmp_path)
    decode = _worker("d0", "decode", ns, nats_server, etcd_server, tmp_path)
    bus = Bus(nats_server.url, name="test-planner")
    await bus.connect()
    async with httpx.AsyncClient(trust_env=False) as http:
        try:
            await asyncio.gather(prefill.start(), decode.start())
            assert await _forecast(http, prefill) == {"isl": None, "policy": "dopd-length", "applies": True}

            event = PlannerEvent(kind="forecast", ts_unix_s=time.time(), replica_id="test", source="policy",
                                 forecast_isl=1234.5, forecast_osl=200.0)
            await bus.publish(Subjects(ns).planner_events(), event)
            await _until_forecast(http, prefill, 1234.5, timeout_s=10.0)
            assert (await _forecast(http, decode))["isl"] is None  # decode engines do not prefill

            # No newer forecast: after the TTL the policy goes back to its own running mean.
            waited = await _until_forecast(http, prefill, None, timeout_s=10.0)
            assert waited > 0.5

            # A malformed forecast: an OpenAI-style error (flat, as SGLang's), and the engine keeps serving.
            bad = await http.post(f"http://127.0.0.1:{prefill.settings.engine_port}{FORECAST_PATH}", json={"isl": "x"})
            assert bad.status_code == 400 and bad.json()["param"] == "isl"  # SGLang's ErrorResponse shape
        finally:
            await asyncio.gather(prefill.stop(), decode.stop())
            await bus.close()
