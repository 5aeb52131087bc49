"""The gateway's lifecycle: one NATS connection, one etcd client, one HTTP client pool to the engines."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import time

import httpx

from services.gateway.cluster import ClusterView
from services.gateway.config import GatewaySettings
from services.gateway.flow import RequestFlow
from services.gateway.metrics import GatewayMetrics
from shared.bus import Bus, bus_from_settings
from shared.policies import DispatchParams, DispatchPolicy, make_dispatch_policy
from shared.protocol import (
    AdminCommand,
    AdminReply,
    InstanceInfo,
    Keys,
    LoadReport,
    RequestEvent,
    ServiceStatus,
    Subjects,
)
from shared.registry import InstanceWatcher, Registry
from shared.tokens import TokenCounter, make_counter

log = logging.getLogger(__name__)


class GatewayService:
    def __init__(self, settings: GatewaySettings) -> None:
        self.settings = settings
        self.subjects = Subjects(settings.namespace)
        self.keys = Keys(settings.namespace)
        self.cluster = ClusterView()
        self.metrics = GatewayMetrics()
        self.policy: DispatchPolicy = make_dispatch_policy(
            settings.dispatch_policy, DispatchParams(max_pending_per_engine=settings.max_pending_per_engine))
        self.counter: TokenCounter = make_counter(settings.tokenizer)
        self.replica_id = f"{socket.gethostname()}:{os.getpid()}"
        self.bus: Bus | None = None
        self.registry: Registry | None = None
        self.http: httpx.AsyncClient | None = None
        self._watcher: InstanceWatcher | None = None
        self._started_at = time.monotonic()
        self._stopped = False
        self._background: set[asyncio.Task[None]] = set()

    async def start(self) -> None:
        s = self.settings
        self.http = httpx.AsyncClient(
            timeout=httpx.Timeout(connect=s.engine_connect_timeout_s, read=s.first_token_timeout_s, write=30.0, pool=30.0),
            limits=httpx.Limits(max_connections=4096, max_keepalive_connections=1024),
        )
        self.bus = bus_from_settings(s, f"gateway-{self.replica_id}")
        await self.bus.connect()
        await self.bus.subscribe(self.subjects.load_all(), LoadReport, self.cluster.on_load)
        await self.bus.serve(self.subjects.admin("gateway"), AdminCommand, self._admin,
                             error_reply=lambda m: AdminReply(ok=False, message=m), queue="gateway-admin")
        self.registry = Registry(s.etcd_url, self.keys)
        await self.registry.connect()
        self._watcher = InstanceWatcher(self.registry, on_change=self._on_instances)
        await self._watcher.start()
        log.info("gateway ready on %s:%d (policy %s, %d instances)", s.host, s.port, self.policy.name,
                 len(self.cluster.instances))

    async def stop(self) -> None:
        if self._stopped:
            return
        self._stopped = True
        for task in list(self._background):
            task.cancel()
        if self._watcher is not None:
            await self._watcher.stop()
        if self.registry is not None:
            await self.registry.close()
        if self.bus is not None:
            await self.bus.close()
        if self.http is not None:
            await self.http.aclose()

    def _on_instances(self, instances: dict[str, InstanceInfo]) -> None:
        self.cluster.set_instances(instances)
        self.metrics.instances.clear()
        for info in instances.values():
            self.metrics.instances.labels(info.role, info.status).inc()

    def new_flow(self, parsed) -> RequestFlow:  # type: ignore[no-untyped-def]
        assert self.http is not None
        return RequestFlow(parsed, cluster=self.cluster, policy=self.policy, http=self.http, metrics=self.metrics,
                           retries=self.settings.retries, first_token_timeout_s=self.settings.first_token_timeout_s)

    def record(self, flow: RequestFlow) -> None:
        """Metrics and the monitor's event for a finished request (never blocks the response)."""
        o = flow.outcome
        m = self.metrics
        m.requests.labels(flow.parsed.endpoint, o.status).inc()
        e2e = time.monotonic() - flow.arrived
        ttft, tpot = flow.ttft_s(), flow.tpot_s()
        m.e2e.observe(e2e)
        if ttft is not None:
            m.ttft.observe(ttft)
        if tpot is not None:
            m.tpot.observe(tpot)
        m.prompt_tokens.inc(flow.parsed.input_tokens)
        m.output_tokens.inc(o.output_tokens)
        if self.settings.publish_events and self.bus is not None and self.bus.is_connected:
            event = RequestEvent(
                rid=flow.client_id, model=flow.parsed.model, arrived_unix_s=flow.arrived_unix,
                finished_unix_s=flow.arrived_unix + e2e, prefill_id=o.prefill_id, decode_id=o.decode_id,
                input_tokens=flow.parsed.input_tokens, output_tokens=o.output_tokens, ttft_s=ttft, tpot_s=tpot,
                status=o.status,  # type: ignore[arg-type]
                error=o.error,
            )
            task = asyncio.create_task(self._publish_event(event))
            self._background.add(task)
            task.add_done_callback(self._background.discard)

    async def _publish_event(self, event: RequestEvent) -> None:
        assert self.bus is not None
        with contextlib.suppress(Exception):
            await self.bus.publish(self.subjects.request_events(), event)

    async def _admin(self, cmd: AdminCommand) -> AdminReply:
        if cmd.verb != "status":
            return AdminReply(ok=False, message=f"unknown verb {cmd.verb!r}; the gateway answers: status")
        return AdminReply(ok=True, status=ServiceStatus(
            service="gateway", replica_id=self.replica_id, is_leader=True, policy=self.policy.name,
            policy_note="dispatch: least pending prompt tokens (prefill), least KV use (decode)",
            uptime_s=time.monotonic() - self._started_at,
            details={"inflight": self.cluster.inflight_total(), "instances": len(self.cluster.instances),
                     "listen": f"{self.settings.host}:{self.settings.port}", "token_counter": getattr(self.counter, "name", "")},
        ))
