"""The sidecar's relay of the planner's ISL forecast: when to send it, and when to withdraw it."""

from __future__ import annotations

from typing import Any

from services.engine_sim.reports import ENGINE_NAME
from services.worker.config import WorkerSettings
from services.worker.forecast import ForecastRelay
from services.worker.sidecar import WorkerService
from shared.engine_client import EngineServerInfo
from shared.latency import LatencyModel, load_profile
from shared.policies.context import PolicyContext
from shared.policies.dopd import DopdParams, Split, forecast_split, optimal_split
from shared.settings import load_settings


def test_every_forecast_is_sent_and_one_without_an_isl_is_not() -> None:
    relay = ForecastRelay(ttl_s=30.0)
    assert relay.heard(2000.0, now=0.0) == 2000.0
    assert relay.heard(2000.0, now=10.0) == 2000.0  # again: an engine restarted in between gets it back
    assert relay.heard(None, now=11.0) is None
    assert relay.heard(0.0, now=12.0) is None
    assert relay.isl == 2000.0


def test_a_forecast_is_withdrawn_once_after_its_ttl() -> None:
    relay = ForecastRelay(ttl_s=30.0)
    assert not relay.stale(now=100.0)  # nothing sent, nothing to withdraw
    relay.heard(1800.0, now=0.0)
    assert not relay.stale(now=30.0)
    assert relay.stale(now=30.5)
    assert not relay.stale(now=31.0)  # withdrawn already
    relay.heard(1900.0, now=40.0)
    assert not relay.stale(now=60.0)


def test_forecast_split_finds_dopd_inside_a_mix() -> None:
    split = optimal_split(LatencyModel(load_profile()), PolicyContext(ttft_slo_s=2.0, tpot_slo_s=0.15, max_instances=8),
                          1000.0, 200.0, 40.0, 5.0, DopdParams())
    assert isinstance(split, Split)

    class Dopd:
        last_split = split

    class Mix:
        dopd = Dopd()

    assert forecast_split(Dopd()) is split
    assert forecast_split(Mix()) is split
    assert forecast_split(object()) is None


def _worker(kind: str, **settings: Any) -> WorkerService:
    return WorkerService(load_settings(WorkerSettings, instance_id="p0", role="prefill", engine_kind=kind,
                                       model="m", **settings))


def _info(raw: dict[str, Any]) -> EngineServerInfo:
    return EngineServerInfo(max_total_num_tokens=None, max_running_requests=None, disaggregation_mode="prefill",
                            disaggregation_bootstrap_port=None, served_model_name=None, raw=raw)


def test_only_engine_sim_is_sent_forecasts() -> None:
    # SGLang has no /poise_sim/forecast: its sidecar must not call it (nor subscribe for nothing).
    assert _worker("sim")._takes_forecast()
    assert not _worker("sglang", model_path="/models/x")._takes_forecast()
    attached = _worker("attach", engine_url="http://127.0.0.1:30000")
    assert not attached._takes_forecast()  # unknown until /server_info says what it is
    attached._engine_info = _info({"engine": "sglang"})
    assert not attached._takes_forecast()
    attached._engine_info = _info({"engine": ENGINE_NAME})
    assert attached._takes_forecast()
