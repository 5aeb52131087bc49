"""The planner's ISL forecast reaches an engine_sim prefill engine's dopd-length batching through its sidecar.

Real nats-server (with the deployment's per-user permissions), etcd, worker sidecars and engine_sim
processes: a ``forecast`` PlannerEvent that the planner user publishes on NATS sets the forecast, and with it
the long-prompt threshold, of the prefill engine's ``dopd-length`` policy (``GET /poise_sim/forecast``);
each newer forecast restarts the clock, and without one the sidecar withdraws it after ``forecast_ttl_s``
(the threshold goes back to the policy's own). A decode engine's sidecar passes nothing on. The sidecars
connect as their own NATS users (``worker-<id>``), so the permission to hear the planner's events is tested.
"""

from __future__ import annotations

import asyncio
import time
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
from tests.conftest import AUTHZ_NAMESPACE

pytestmark = pytest.mark.asyncio
TTL_S = 3.0


def _worker(instance_id: str, role: str, nats: NatsServer, etcd: EtcdServer, tmp: Path) -> WorkerService:
    return WorkerService(load_settings(
        WorkerSettings, instance_id=instance_id, role=role, engine_kind="sim", model="sim-model", time_scale=0.0,
        namespace=AUTHZ_NAMESPACE, nats_url=nats.url_for(f"worker-{instance_id}"), etcd_url=etcd.url,
        load_interval_s=0.1, lease_ttl_s=2, health_timeout_s=30, stop_timeout_s=5, log_dir=tmp,
        forecast_ttl_s=TTL_S, extra_args=["--prefill-policy", "dopd-length"]))


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


def _event(isl: float) -> PlannerEvent:
    return PlannerEvent(kind="forecast", ts_unix_s=time.time(), replica_id="test", source="policy",
                        forecast_isl=isl, forecast_osl=200.0)


async def test_planner_forecast_reaches_the_prefill_engine_and_expires(nats_server: NatsServer, etcd_server: EtcdServer,
                                                                       tmp_path: Path) -> None:
    prefill = _worker("p3", "prefill", nats_server, etcd_server, tmp_path)
    decode = _worker("d3", "decode", nats_server, etcd_server, tmp_path)
    planner = Bus(nats_server.url_for("planner"), name="test-planner")  # publishes as the planner does
    await planner.connect()
    events = Subjects(AUTHZ_NAMESPACE).planner_events()
    async with httpx.AsyncClient(trust_env=False) as http:
        try:
            await asyncio.gather(prefill.start(), decode.start())
            before = await _forecast(http, prefill)
            own = before.pop("long_threshold")  # no prompt seen yet: the profile's chunk size
            assert before == {"isl": None, "policy": "dopd-length", "applies": True}
            assert isinstance(own, float | int) and own != 1234.5

            await planner.publish(events, _event(1234.5))
            await _until_forecast(http, prefill, 1234.5, timeout_s=10.0)
            assert (await _forecast(http, prefill))["long_threshold"] == 1234.5  # the batching threshold moved
            assert (await _forecast(http, decode))["isl"] is None  # decode engines do not prefill
            assert not prefill._bus.permission_errors  # type: ignore[union-attr]

            # A newer forecast restarts the clock: past the first one's TTL the second still holds.
            await asyncio.sleep(TTL_S * 0.6)
            await planner.publish(events, _event(1300.0))
            await _until_forecast(http, prefill, 1300.0, timeout_s=10.0)
            await asyncio.sleep(TTL_S * 0.6)
            assert (await _forecast(http, prefill))["isl"] == 1300.0

            # No newer forecast: after the TTL the policy goes back to its own threshold.
            await _until_forecast(http, prefill, None, timeout_s=10.0)
            assert (await _forecast(http, prefill))["long_threshold"] == own

            # A malformed forecast: an OpenAI-style error (flat, as SGLang's), and the engine keeps serving.
            bad = await http.post(f"http://127.0.0.1:{prefill.settings.engine_port}{FORECAST_PATH}", json={"isl": "x"})
            assert bad.status_code == 400 and bad.json()["param"] == "isl"  # SGLang's ErrorResponse shape
        finally:
            await asyncio.gather(prefill.stop(), decode.stop())
            await planner.close()
