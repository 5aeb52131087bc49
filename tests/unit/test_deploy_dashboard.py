"""The provisioned Grafana dashboard queries only metrics that Poise's processes really export.

The exported names come from the metric objects themselves: the gateway's and engine_sim's registries and the
monitor's collector (fed one series point so its conditional gauges appear), not from a list kept here.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
import yaml
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

from services.engine_sim.metrics import EngineMetrics
from services.gateway import metrics as gateway_metrics
from services.gateway.metrics import GatewayMetrics
from services.monitor.config import MonitorSettings
from services.monitor.metrics import MonitorCollector
from services.monitor.service import MonitorService
from shared.protocol.messages import SeriesPoint

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
DASHBOARD = DEPLOY / "grafana" / "dashboards" / "poise.json"
# The metrics SGLang 0.5.23 defines, extracted from the wheel's source (tests/contract/fixtures/).
SGLANG_METRICS = DEPLOY.parent / "tests" / "contract" / "fixtures" / "sglang-0.5.23" / "metrics.json"
METRIC = re.compile(r"\b(?:poise|sglang)[_:][A-Za-z0-9_:]*")
SUFFIXES = {"counter": ("_total",), "histogram": ("_bucket", "_count", "_sum"), "gauge": ("",), "summary": ("_count", "_sum")}


def _sample_names(collector: Collector) -> set[str]:
    names: set[str] = set()
    for family in collector.collect():
        names |= {family.name + suffix for suffix in SUFFIXES.get(family.type, ("",))}
    return names


@pytest.fixture(scope="module")
def exported() -> set[str]:
    monitor = MonitorService(MonitorSettings())
    monitor.series.append(SeriesPoint(start_unix_s=0.0, interval_s=5.0, arrivals=1, arrival_rate_rps=0.2, completed=1,
                                      mean_input_tokens=10.0, mean_output_tokens=5.0, mean_running_reqs=1.0,
                                      ttft_p90_s=0.1, tpot_p90_s=0.01))
    engine = EngineMetrics(model_name="m", mode="prefill", role_switch_enabled=True)
    return (_sample_names(GatewayMetrics().registry) | _sample_names(engine.registry)
            | _sample_names(MonitorCollector(monitor)))


@pytest.fixture(scope="module")
def dashboard() -> dict[str, Any]:
    data = json.loads(DASHBOARD.read_text())
    assert isinstance(data, dict)
    return data


def _targets(dashboard: dict[str, Any]) -> list[dict[str, Any]]:
    return [t for p in dashboard["panels"] for t in p.get("targets", [])]


def _variable(dashboard: dict[str, Any], name: str) -> dict[str, Any]:
    return next(v for v in dashboard["templating"]["list"] if v["name"] == name)


def test_every_queried_metric_is_exported(dashboard: dict[str, Any], exported: set[str]) -> None:
    used = {name for t in _targets(dashboard) for name in METRIC.findall(t["expr"])}
    assert used, "the dashboard queries no Poise metric"
    assert used - exported == set()


def test_engine_panels_work_on_real_sglang_too(dashboard: dict[str, Any]) -> None:
    sglang = json.loads(SGLANG_METRICS.read_text())["metrics"]
    used = {name for t in _targets(dashboard) for name in METRIC.findall(t["expr"]) if name.startswith("sglang:")}
    assert used and used - set(sglang) == set()


def test_the_asked_for_panels_are_there(dashboard: dict[str, Any]) -> None:
    exprs = " ".join(t["expr"] for t in _targets(dashboard))
    for needed in ("poise_gateway_ttft_seconds_bucket", "poise_gateway_tpot_seconds_bucket",  # SLO attainment, p-tiles
                   "poise_cluster_instances",  # pools over time
                   "poise_gateway_migrations_total", "poise_gateway_rescues_total",  # migrations
                   "poise_arrival_rate_rps",  # the series the planner forecasts from...
                   "poise_planner_forecast", "poise_planner_flips_total"):  # ...its forecast and its flips
        assert needed in exprs
    assert "histogram_quantile(0.99" in exprs
    titles = {p["title"] for p in dashboard["panels"]}
    assert {"Flips and the policy's target split", "Instances by role (pools over time)", "Moves and rescues",
            "Arrival rate and concurrency: forecast vs actual"} <= titles


@pytest.mark.parametrize(("variable", "histogram"), [("ttft_slo", "ttft"), ("tpot_slo", "tpot")])
def test_slo_choices_are_bucket_bounds(dashboard: dict[str, Any], variable: str, histogram: str) -> None:
    # le="$ttft_slo" only matches a series when the value is one of the histogram's bounds, spelled as the
    # client library spells it (2 -> "2.0").
    bounds = {floatToGoString(b) for b in getattr(gateway_metrics, f"{'LATENCY' if histogram == 'ttft' else 'TPOT'}_BUCKETS")}
    values = {o["value"] for o in _variable(dashboard, variable)["options"]}
    assert values <= bounds
    assert _variable(dashboard, variable)["current"]["value"] in values


def test_dashboard_uses_the_provisioned_datasource(dashboard: dict[str, Any]) -> None:
    provisioned = yaml.safe_load((DEPLOY / "grafana" / "provisioning" / "datasources" / "prometheus.yml").read_text())
    uid = provisioned["datasources"][0]["uid"]
    for panel in dashboard["panels"]:
        if panel["type"] != "row":
            assert panel["datasource"]["uid"] == uid
            assert all(t["datasource"]["uid"] == uid for t in panel["targets"])
    provider = yaml.safe_load((DEPLOY / "grafana" / "provisioning" / "dashboards" / "poise.yml").read_text())
    assert provider["providers"][0]["options"]["path"] == "/var/lib/grafana/dashboards"


def test_panel_ids_are_unique_and_panels_fit_the_grid(dashboard: dict[str, Any]) -> None:
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids))
    for p in dashboard["panels"]:
        pos = p["gridPos"]
        assert pos["x"] >= 0 and pos["x"] + pos["w"] <= 24
