"""The monitor service: the cluster's telemetry in one place.

Inputs: :class:`LoadReport` on ``Subjects.load_all()`` (sidecars, ~4 Hz each), :class:`RequestEventBatch` on
``Subjects.request_events()`` (gateways), and the etcd instance registry (mirrored by
:class:`InstanceWatcher`). Outputs:

- ``Subjects.monitor_snapshot()``: :class:`SnapshotRequest` -> :class:`SnapshotReply` with a
  :class:`ClusterSnapshot`: every *registered* instance with its latest load and that load's age (loads of
  unregistered instances are left out), plus the newest series points;
- the rolling series (:class:`SeriesBuilder`, one point per ``series_interval_s``);
- ``/metrics`` for Prometheus (``services.monitor.metrics``), when ``http_port`` is not 0;
- admin ``status`` on ``Subjects.admin("monitor")``.

Load ages are measured on the monitor's monotonic clock from when a report arrived, so clock skew between
hosts does not make loads look fresh or stale.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from services.monitor.config import MonitorSettings
from shared.bus import Bus, bus_from_settings
from shared.protocol import (
    ClusterSnapshot,
    InstanceInfo,
    InstanceLoad,
    Keys,
    LoadReport,
    PlannerEvent,
    RequestEvent,
    RequestEventBatch,
    SeriesPoint,
    ServiceStatus,
    SnapshotReply,
    SnapshotRequest,
    Subjects,
)
from shared.registry import InstanceWatcher, Registry, registry_from_settings
from shared.runtime import (
    AdminEndpoint,
    AsyncServiceMixin,
    EmbeddedHttpServer,
    StopOnce,
    Uptime,
    cancel_and_wait,
    replica_id,
)
from shared.series import SeriesBuilder

log = logging.getLogger(__name__)

SNAPSHOT_QUEUE = "monitor"  # several monitor replicas answer snapshot requests once between them
FORGET_LOADS_AFTER_S = 60.0  # drop the last report of an instance that is neither registered nor reporting


@dataclass
class Counters:
    """Totals since the monitor started (Prometheus counters and ``status``)."""

    requests_by_status: dict[str, int] = field(default_factory=dict)
    input_tokens: int = 0
    output_tokens: int = 0
    load_reports: int = 0
    events: int = 0


@dataclass
class PlannerView:
    """What the planner last said it did and predicted (its events), for the dashboards: flips by role and
    outcome, the target split, and DOPD's forecast next to the series the monitor measures."""

    flips: dict[tuple[str, str], int] = field(default_factory=dict)  # (to_role, done|failed) -> count
    target: dict[str, int] = field(default_factory=dict)  # role -> instances the policy wants
    forecast: dict[str, float] = field(default_factory=dict)  # rate_rps, isl, osl, concurrency, ratio

    def on_event(self, event: PlannerEvent) -> None:
        if event.kind in ("flip_done", "flip_failed"):
            key = (event.to_role or "unknown", "done" if event.kind == "flip_done" else "failed")
            self.flips[key] = self.flips.get(key, 0) + 1
        elif event.kind == "resize_requested" and event.target_prefill is not None:
            self.target = {"prefill": event.target_prefill, "decode": event.target_decode or 0}
        elif event.kind == "forecast":
            values = {"rate_rps": event.forecast_rate_rps, "isl": event.forecast_isl, "osl": event.forecast_osl,
                      "concurrency": event.forecast_concurrency, "ratio": event.forecast_ratio}
            self.forecast = {k: v for k, v in values.items() if v is not None}


class MonitorService(AsyncServiceMixin):
    """See the module docstring."""

    name = "monitor"

    def __init__(self, settings: MonitorSettings, *, wall_clock: Callable[[], float] = time.time) -> None:
        self.settings = settings
        self.subjects = Subjects(settings.namespace)
        self.keys = Keys(settings.namespace)
        self._wall = wall_clock
        self.instances: dict[str, InstanceInfo] = {}
        self._loads: dict[str, tuple[LoadReport, float]] = {}  # instance -> (report, monotonic arrival)
        self.series: deque[SeriesPoint] = deque(maxlen=settings.series_length)
        self.builder = SeriesBuilder(wall_clock())
        self.counters = Counters()
        self.planner = PlannerView()
        self._replica_id = replica_id()
        self._uptime = Uptime()
        self._bus: Bus | None = None
        self._registry: Registry | None = None
        self._watcher: InstanceWatcher | None = None
        self._admin: AdminEndpoint | None = None
        self._http: EmbeddedHttpServer | None = None
        self._subs: list[Any] = []
        self._tasks: list[asyncio.Task[None]] = []
        self._stop = StopOnce()

    @property
    def http_port(self) -> int | None:
        """The port /metrics is served on, ``None`` when the HTTP server is off (``http_port=0``)."""
        return self._http.port if self._http is not None else None

    # -- lifecycle ---------------------------------------------------------------------------------
    async def start(self) -> None:
        s = self.settings
        self._bus = bus_from_settings(s, name="poise-monitor")
        await self._bus.connect()
        self._registry = registry_from_settings(s, self.keys)
        await self._registry.connect()
        self._watcher = InstanceWatcher(self._registry, on_change=self._on_instances)
        await self._watcher.start()
        self.builder = SeriesBuilder(self._wall())
        self._subs.append(await self._bus.subscribe(self.subjects.load_all(), LoadReport, self._on_load))
        self._subs.append(await self._bus.subscribe(self.subjects.request_events(), RequestEventBatch, self._on_events))
        self._subs.append(await self._bus.subscribe(self.subjects.planner_events(), PlannerEvent, self._on_planner_event))
        self._subs.append(await self._bus.serve(
            self.subjects.monitor_snapshot(), SnapshotRequest, self._on_snapshot_request,
            error_reply=lambda m: SnapshotReply(ok=False, message=m), queue=SNAPSHOT_QUEUE,
        ))
        self._admin = AdminEndpoint(self._bus, self.subjects, self.name, self.service_status)
        await self._admin.start()
        self._tasks.append(asyncio.create_task(self._series_loop(), name="monitor-series"))
        if s.http_port:
            from services.monitor.metrics import create_app

            self._http = EmbeddedHttpServer(create_app(self), s.http_host, s.http_port, name="monitor-metrics")
            await self._http.start()
            log.info("monitor /metrics on http://%s:%d/metrics", s.http_host, self._http.port)

    async def stop(self) -> None:
        await self._stop.run(self._stop_once)

    async def _stop_once(self) -> None:
        await cancel_and_wait(self._tasks)
        self._tasks.clear()
        if self._http is not None:
            await self._http.stop()
        if self._admin is not None:
            await self._admin.stop()
        if self._watcher is not None:
            await self._watcher.stop()
        if self._bus is not None:
            await self._bus.close()
        if self._registry is not None:
            await self._registry.close()

    # -- inputs ------------------------------------------------------------------------------------
    def _on_instances(self, instances: dict[str, InstanceInfo]) -> None:
        self.instances = instances

    async def _on_load(self, report: LoadReport, subject: str) -> None:
        self._loads[report.instance_id] = (report, time.monotonic())
        self.builder.add_load(report)
        self.counters.load_reports += 1

    async def _on_planner_event(self, event: PlannerEvent, subject: str) -> None:
        self.planner.on_event(event)

    async def _on_events(self, batch: RequestEventBatch, subject: str) -> None:
        for event in batch.events:
            self._on_event(event)

    def _on_event(self, event: RequestEvent) -> None:
        self.builder.add_event(event)
        c = self.counters
        c.events += 1
        c.requests_by_status[event.status] = c.requests_by_status.get(event.status, 0) + 1
        c.input_tokens += event.input_tokens
        c.output_tokens += event.output_tokens

    async def _series_loop(self) -> None:
        interval = self.settings.series_interval_s
        next_at = time.monotonic() + interval
        while True:
            await asyncio.sleep(max(0.0, next_at - time.monotonic()))
            next_at += interval
            self.roll()

    def roll(self) -> SeriesPoint:
        """Close the current series interval now (the loop calls this every ``series_interval_s``)."""
        point = self.builder.roll(self._wall())
        self.series.append(point)
        now = time.monotonic()
        for instance_id, (_, received) in list(self._loads.items()):
            if instance_id not in self.instances and now - received > FORGET_LOADS_AFTER_S:
                del self._loads[instance_id]
        return point

    # -- outputs -----------------------------------------------------------------------------------
    def instance_loads(self) -> list[InstanceLoad]:
        """Every registered instance with its latest load (``None`` before the first) and that load's age."""
        now = time.monotonic()
        out = []
        for instance_id in sorted(self.instances):
            entry = self._loads.get(instance_id)
            if entry is None:
                out.append(InstanceLoad(info=self.instances[instance_id], load=None, load_age_s=None))
            else:
                out.append(InstanceLoad(info=self.instances[instance_id], load=entry[0], load_age_s=now - entry[1]))
        return out

    def snapshot(self, series_points: int = 60) -> ClusterSnapshot:
        series = list(self.series)[-series_points:] if series_points > 0 else []
        return ClusterSnapshot(ts_unix_s=self._wall(), instances=self.instance_loads(), series=series)

    async def _on_snapshot_request(self, request: SnapshotRequest) -> SnapshotReply:
        return SnapshotReply(ok=True, snapshot=self.snapshot(request.series_points))

    def service_status(self) -> ServiceStatus:
        loads = self.instance_loads()
        stale = [i.info.instance_id for i in loads
                 if i.load_age_s is None or i.load_age_s > self.settings.stale_after_s or not (i.load and i.load.healthy)]
        roles: dict[str, int] = {}
        for i in loads:
            roles[i.info.role] = roles.get(i.info.role, 0) + 1
        last = self.series[-1] if self.series else None
        return ServiceStatus(
            service=self.name, replica_id=self._replica_id, is_leader=False, policy="-",
            policy_note="telemetry only: serves cluster snapshots, series and /metrics",
            uptime_s=self._uptime(),
            details={
                "instances": len(loads), "instances_by_role": roles, "stale_or_unhealthy": stale,
                "load_reports": self.counters.load_reports, "request_events": self.counters.events,
                "series_points": len(self.series), "arrival_rate_rps": last.arrival_rate_rps if last else None,
                "metrics_url": f"http://{self.settings.http_host}:{self._http.port}/metrics" if self._http else None,
            },
        )
