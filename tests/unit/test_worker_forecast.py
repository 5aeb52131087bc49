"""The sidecar's relay of the planner's ISL forecast: when to send it, and when to withdraw it."""

from __future__ import annotations

from services.engine_sim.reports import ENGINE_NAME
from services.worker.forecast import ForecastRelay, takes_forecast


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


def test_only_engine_sim_is_sent_forecasts() -> None:
    # SGLang has no /poise_sim/forecast: its sidecar must not call it (nor subscribe for nothing).
    assert takes_forecast("sim", {})
    assert not takes_forecast("sglang", {"engine": ENGINE_NAME})
    assert not takes_forecast("attach", {})  # unknown until /server_info says what it is
    assert not takes_forecast("attach", {"engine": "sglang"})
    assert takes_forecast("attach", {"engine": ENGINE_NAME})
