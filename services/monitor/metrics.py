"""The monitor's Prometheus exposition: a collector over the monitor's state and a tiny FastAPI app.

Gauges are computed at scrape time from the latest load reports, so an instance that leaves the registry
leaves the metrics with it (no stale label sets). Names use the ``poise_`` prefix; per-instance series carry
``instance`` and ``role`` labels.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

from fastapi import FastAPI
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from shared.protocol import encode

if TYPE_CHECKING:
    from services.monitor.service import MonitorService


class MonitorCollector(Collector):
    """Reads :class:`MonitorService` state on every scrape."""

    def __init__(self, monitor: MonitorService) -> None:
        self._monitor = monitor

    def collect(self) -> Iterator[Metric]:
        m = self._monitor
        labels = ["instance", "role"]
        running = GaugeMetricFamily("poise_instance_running_reqs", "Requests running on the engine (latest load report).", labels=labels)
        waiting = GaugeMetricFamily("poise_instance_waiting_reqs", "Requests waiting in the engine's queue (latest load report).", labels=labels)
        usage = GaugeMetricFamily("poise_instance_token_usage", "KV cache usage, 0..1 (latest load report).", labels=labels)
        queued = GaugeMetricFamily("poise_instance_disagg_queue_reqs", "Requests in the prefill bootstrap/inflight or decode prealloc/transfer queues.", labels=labels)
        up = GaugeMetricFamily("poise_instance_up", "1 when the latest load report is fresh and healthy, else 0.", labels=labels)
        age = GaugeMetricFamily("poise_instance_load_age_seconds", "Seconds since the instance's latest load report.", labels=labels)
        ready = GaugeMetricFamily("poise_instance_ready", "1 when the instance is registered as ready (not starting/draining/switching).", labels=labels)
        by_role: dict[str, int] = {"prefill": 0, "decode": 0, "null": 0}
        for inst in m.instance_loads():
            info, load = inst.info, inst.load
            lv = [info.instance_id, info.role]
            by_role[info.role] = by_role.get(info.role, 0) + 1
            ready.add_metric(lv, 1.0 if info.status == "ready" else 0.0)
            fresh = inst.load_age_s is not None and inst.load_age_s <= m.settings.stale_after_s
            up.add_metric(lv, 1.0 if (load is not None and load.healthy and fresh) else 0.0)
            if load is None or inst.load_age_s is None:
                continue
            age.add_metric(lv, inst.load_age_s)
            running.add_metric(lv, load.num_running_reqs)
            waiting.add_metric(lv, load.num_waiting_reqs)
            usage.add_metric(lv, load.token_usage)
            queued.add_metric(lv, load.prefill_queue_reqs + load.decode_queue_reqs)
        yield from (running, waiting, usage, queued, up, age, ready)

        instances = GaugeMetricFamily("poise_cluster_instances", "Registered instances per role.", labels=["role"])
        for role, n in sorted(by_role.items()):
            instances.add_metric([role], n)
        yield instances

        last = m.series[-1] if m.series else None
        yield GaugeMetricFamily("poise_arrival_rate_rps", "Request arrivals per second in the last closed series interval.",
                                value=last.arrival_rate_rps if last else 0.0)
        yield GaugeMetricFamily("poise_cluster_running_reqs", "Mean cluster-wide running requests in the last closed series interval.",
                                value=last.mean_running_reqs if last else 0.0)
        for name, attr, doc in (("poise_ttft_p90_seconds", "ttft_p90_s", "p90 time to first token in the last closed interval."),
                                ("poise_tpot_p90_seconds", "tpot_p90_s", "p90 time per output token in the last closed interval.")):
            value = getattr(last, attr) if last else None
            if value is not None:
                yield GaugeMetricFamily(name, doc, value=value)

        for name, attr, doc in (("poise_mean_input_tokens", "mean_input_tokens", "Mean prompt tokens of the requests finished in the last closed interval."),
                                ("poise_mean_output_tokens", "mean_output_tokens", "Mean output tokens of the requests finished in the last closed interval.")):
            yield GaugeMetricFamily(name, doc, value=getattr(last, attr) if last else 0.0)
        yield from _planner_metrics(m)

        c = m.counters
        requests = CounterMetricFamily("poise_requests", "Finished requests reported by gateways, by status.", labels=["status"])
        for status, n in sorted(c.requests_by_status.items()):
            requests.add_metric([status], n)
        yield requests
        yield CounterMetricFamily("poise_request_input_tokens", "Prompt tokens of finished requests.", value=c.input_tokens)
        yield CounterMetricFamily("poise_request_output_tokens", "Generated tokens of finished requests.", value=c.output_tokens)
        yield CounterMetricFamily("poise_load_reports", "Load reports received from sidecars.", value=c.load_reports)


def _planner_metrics(m: MonitorService) -> Iterator[Metric]:
    """What the planner's events say: flips, its target split and DOPD's forecast (the planner has no HTTP
    server; the monitor already listens to everything on NATS)."""
    p = m.planner
    flips = CounterMetricFamily("poise_planner_flips", "Role flips the planner finished, by new role and outcome.",
                                labels=["to_role", "outcome"])
    for (role, outcome), n in sorted(p.flips.items()):
        flips.add_metric([role, outcome], n)
    yield flips
    target = GaugeMetricFamily("poise_planner_target_instances", "Instances per role the pool policy wants.",
                               labels=["role"])
    for role, n in sorted(p.target.items()):
        target.add_metric([role], n)
    yield target
    forecast = GaugeMetricFamily("poise_planner_forecast", "DOPD's latest forecast for the next interval: rate_rps, "
                                 "isl, osl, concurrency, and the P:D ratio it computed.", labels=["quantity"])
    for quantity, value in sorted(p.forecast.items()):
        forecast.add_metric([quantity], value)
    yield forecast


def build_registry(monitor: MonitorService) -> CollectorRegistry:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(MonitorCollector(monitor))
    return registry


def create_app(monitor: MonitorService) -> FastAPI:
    """``/metrics`` (Prometheus), ``/snapshot`` (the ClusterSnapshot as JSON), ``/healthz``."""
    registry = build_registry(monitor)
    app = FastAPI(title="poise monitor", docs_url=None, redoc_url=None, openapi_url=None)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/snapshot")
    async def snapshot(series_points: int = 60) -> Response:
        return Response(encode(monitor.snapshot(series_points)), media_type="application/json")

    @app.get("/healthz")
    async def healthz() -> JSONResponse:
        return JSONResponse({"ok": True, "instances": len(monitor.instances)})

    return app
