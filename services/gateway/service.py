"""The gateway's lifecycle: one NATS connection, one etcd client, one HTTP client pool to the engines.

It also answers the migrator: which streaming requests it holds (``Subjects.gateway_requests``) and moves
one to another decode engine on command (``Subjects.gateway_move``, carried out by the request's flow).
"""

from __future__ import annotations

import asyncio
import logging
import math
import re
import time
from collections.abc import Coroutine
from typing import Any

from services.gateway.admission import Admission
from services.gateway.cluster import ClusterView
from services.gateway.config import GatewaySettings
from services.gateway.flow import RequestFlow
from services.gateway.legs import Attempt
from services.gateway.metrics import GatewayMetrics
from services.gateway.moving import MoveResult
from services.gateway.slo import SloTable
from shared.bus import Bus, bus_from_settings
from shared.engine_client import engine_auth_headers
from shared.gateway.model import GatewayModel
from shared.http1 import Http1Pool
from shared.policies import (
    DispatchParams,
    DispatchPolicy,
    make_dispatch_policy,
    make_prefill_policy,
    with_gateway_rules,
)
from shared.policies.admission import EarlyRejectionParams
from shared.policies.late_binding import LateBinding
from shared.policies.local_prefill import LocalPrefillParams
from shared.protocol import (
    DecodeRequestInfo,
    InstanceInfo,
    Keys,
    LoadReport,
    RequestEvent,
    RequestEventBatch,
    ServiceStatus,
    Subjects,
)
from shared.protocol.moves import GatewayRequests, GatewayRequestsQuery, MoveCommand, MoveReply
from shared.registry import InstanceWatcher, Registry, registry_from_settings
from shared.runtime import AdminEndpoint, replica_id
from shared.tokens import TokenCounter, make_counter

log = logging.getLogger(__name__)

EVENT_FLUSH_INTERVAL_S = 0.25


class GatewayService:
    def __init__(self, settings: GatewaySettings) -> None:
        self.settings = settings
        self.subjects = Subjects(settings.namespace)
        self.keys = Keys(settings.namespace)
        self.cluster = ClusterView()
        self.metrics = GatewayMetrics(slo_ttft_s=settings.slo_ttft_s, slo_tpot_s=settings.slo_tpot_s)
        self.policy: DispatchPolicy = make_dispatch_policy(
            settings.dispatch_policy, settings.latency_model(), settings.policy_context(),
            DispatchParams(max_pending_per_engine=settings.max_pending_per_engine))
        self.policy = with_gateway_rules(
            self.policy, settings.policy_context().ttft_slo_s,
            LocalPrefillParams(max_local_prefill_tokens=settings.local_prefill_max_tokens,
                               max_prefill_queue=settings.local_prefill_max_queue)
            if settings.local_prefill_max_tokens > 0 else None,
            EarlyRejectionParams(factor=settings.early_rejection_factor, colocated=settings.early_rejection_colocated)
            if settings.early_rejection else None)
        self.counter: TokenCounter = make_counter(settings.tokenizer)
        self.slo_table = SloTable.from_settings(settings)
        binding = LateBinding(make_prefill_policy(settings.late_binding_policy, settings.latency_model()),
                              depth=settings.late_binding_depth, guard_decode=settings.early_rejection) \
            if settings.late_binding else None
        self.admission = Admission(GatewayModel(self.policy, binding, ledger=self.cluster.ledger), self.cluster,
                                   self.metrics)
        self.replica_id = replica_id()
        # The subject token naming this replica's move commands (a replica id has ':' and maybe '.').
        self.move_token = re.sub(r"[^A-Za-z0-9_-]", "-", self.replica_id)
        self.flows: dict[str, RequestFlow] = {}  # the requests in flight, by the id the client sees
        self.bus: Bus | None = None
        self.registry: Registry | None = None
        self.http: Http1Pool | None = None
        self._watcher: InstanceWatcher | None = None
        self._admin: AdminEndpoint | None = None
        self._started_at = time.monotonic()
        self._stopped = False
        self._background: set[asyncio.Task[None]] = set()
        self._events: list[RequestEvent] = []
        self._flusher: asyncio.Task[None] | None = None
        self._stall_watch: asyncio.Task[None] | None = None
        self._probing: set[str] = set()  # engines whose /health is being asked (_probe)
        self._probed_at: dict[str, float] = {}  # when the stall sweep last asked an engine (monotonic)

    async def on_load(self, report: LoadReport, subject: str) -> None:
        """A load report from a sidecar: into the cluster view, and its prefill samples to a policy that learns
        from them (Arrow)."""
        await self.cluster.on_load(report, subject)
        observe = getattr(self.policy, "observe_prefill", None)  # Arrow refits its TTFT predictor per instance
        if observe is not None:
            for tokens, seconds in report.prefill_samples:
                observe(report.instance_id, tokens, seconds)

    async def start(self) -> None:
        s = self.settings
        self.http = Http1Pool(connect_timeout_s=s.engine_connect_timeout_s, headers=engine_auth_headers(s.engine_api_key))
        self.bus = bus_from_settings(s, f"gateway-{self.replica_id}")
        await self.bus.connect()
        await self.bus.subscribe(self.subjects.load_all(), LoadReport, self.on_load)
        self._admin = AdminEndpoint(self.bus, self.subjects, "gateway", self._status)
        await self._admin.start()
        await self.bus.serve(self.subjects.gateway_requests(), GatewayRequestsQuery, self._on_requests_query,
                             error_reply=lambda m: GatewayRequests(gateway=self.move_token, requests=[]))
        await self.bus.serve(self.subjects.gateway_move(self.move_token), MoveCommand, self._on_move,
                             error_reply=lambda m: MoveReply(ok=False, message=m), concurrent=True)
        self.registry = registry_from_settings(s, self.keys)
        await self.registry.connect()
        self._watcher = InstanceWatcher(self.registry, on_change=self._on_instances)
        await self._watcher.start()
        self._flusher = asyncio.create_task(self._flush_events_loop(), name="request-event-flusher")
        if s.stall_timeout_s > 0:
            self._stall_watch = asyncio.create_task(self._stall_watch_loop(), name="stalled-stream-watch")
        log.info("gateway ready on %s:%d (policy %s, %d instances, %d SLO classes, late binding %s)", s.host, s.port,
                 self.policy.name, len(self.cluster.instances), len(self.slo_table.classes),
                 f"{s.late_binding_policy} depth {s.late_binding_depth}" if s.late_binding else "off")

    def health(self) -> tuple[dict[str, object], bool]:
        """The gateway's ``/health`` body, and whether it can take requests (a load balancer's question).

        ``ok``: an engine pair (or colocated engine) is ready and the control plane is connected;
        ``degraded``: requests are served from the last view of the instances, but NATS or the etcd watch is
        down (no load reports or membership changes reach the gateway); ``unavailable``: no model has a ready
        pair; ``draining``: the gateway is shutting down.
        """
        nats = self.bus is not None and self.bus.is_connected
        etcd = self._watcher is not None and self._watcher.watching
        servable = self.cluster.servable_models()
        if self._stopped:
            status = "draining"
        elif not servable:
            status = "unavailable"
        else:
            status = "ok" if nats and etcd else "degraded"
        engines = self.cluster.instances
        body: dict[str, object] = {
            "status": status, "instances": len(engines), "roles": sorted({i.role for i in engines.values()}),
            "servable_models": servable, "nats": "connected" if nats else "disconnected",
            "etcd_watch": "watching" if etcd else "resyncing", "inflight": self.cluster.inflight_total()}
        return body, status in ("ok", "degraded")

    async def stop(self) -> None:
        if self._stopped:
            return
        self._stopped = True
        if self._flusher is not None:
            self._flusher.cancel()
        if self._stall_watch is not None:
            self._stall_watch.cancel()
        self.admission.close()
        if self._background:  # let in-flight aborts reach the engines before the client pool closes
            await asyncio.wait(list(self._background), timeout=5)
        await self._flush_events()
        if self._admin is not None:
            await self._admin.stop()
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
        left = {e.instance_id: e for _, e in self._awaiting_first_token() if e.instance_id not in instances}
        self._probed_at = {i: t for i, t in self._probed_at.items() if i in instances}
        for engine in left.values():
            self._probe(engine, "left the registry")
        self.metrics.instances.clear()
        for info in instances.values():
            self.metrics.instances.labels(info.role, info.status).inc()
        self.admission.kick()  # a prefill engine came or went: held requests may go (or fail) now

    def _probe(self, engine: InstanceInfo, why: str) -> None:
        """Ask ``engine`` whether it still works (at most one question in flight per engine)."""
        if engine.instance_id not in self._probing:
            self._probing.add(engine.instance_id)
            self.spawn(self._probe_waited_on(engine, why))

    async def _probe_waited_on(self, engine: InstanceInfo, why: str) -> None:
        """Requests wait on ``engine`` for a first token and something says it may be gone: it left the registry
        (its sidecar deregisters an engine that stopped answering, but also one it stops after a drain, and
        the registration goes with a sidecar that died beside a working engine), or a request has waited
        ``stall_timeout_s`` on it (a hung engine whose sidecar has not noticed yet). So ask the engine: one that
        does not answer its /health in ``probe_timeout_s`` is given up, and its waiting requests are tried on
        another pair at once (not after the first-token timeout); one that answers finishes what it has."""
        assert self.http is not None
        try:
            try:
                status, _ = await asyncio.wait_for(self.http.fetch("GET", engine.url + "/health"),
                                                   self.settings.probe_timeout_s)
                if status == 200:
                    return
                answer = f"answered /health with {status}"
            except (OSError, TimeoutError, ValueError) as exc:
                answer = f"did not answer /health ({type(exc).__name__})"
            log.warning("engine %s %s and %s: the requests waiting on it for a first token go to another pair",
                        engine.instance_id, why, answer)
            for attempt, waited_on in self._awaiting_first_token():
                if waited_on.instance_id == engine.instance_id:
                    attempt.engine_gone(engine.instance_id, f"{why} and {answer}")
        finally:
            self._probing.discard(engine.instance_id)

    def _awaiting_first_token(self) -> list[tuple[Attempt, InstanceInfo]]:
        """(attempt, engine) for every engine of every current attempt still waiting for its first token."""
        out = []
        for flow in self.flows.values():
            attempt = flow.attempt
            if attempt is not None and flow.outcome.first_token_at is None:
                out += [(attempt, e) for e in (attempt.prefill, attempt.decode) if e is not None]
        return out

    def new_flow(self, parsed, arrived: float | None = None) -> RequestFlow:  # type: ignore[no-untyped-def]
        assert self.http is not None
        flow = RequestFlow(parsed, cluster=self.cluster, admission=self.admission, http=self.http,
                           metrics=self.metrics, retries=self.settings.retries,
                           first_token_timeout_s=self.settings.first_token_timeout_s, spawn=self.spawn,
                           max_rescues=self.settings.max_rescues,
                           predict_length=self.settings.length_predictions,
                           stream_legs=self.settings.move_non_streaming,
                           refuse_late=self.settings.early_rejection, arrived=arrived)
        self.flows[flow.client_id] = flow
        return flow

    # -- moves (the migrator's side) -------------------------------------------------------------------
    def movable_requests(self) -> list[DecodeRequestInfo]:
        """The requests with a streamed decode leg (streaming clients; non-streaming ones too with
        ``move_non_streaming``) that have a token and no finish yet: what a migration policy chooses among.
        A request being moved is listed on its target with ``migrating`` set (policies count it there and
        leave both instances alone until the move is over)."""
        out = []
        for flow in self.flows.values():
            attempt = flow.attempt
            if attempt is None:
                continue
            moving = flow.moves.moving
            if moving is None and flow.moves.movable() is not None:
                continue
            slo = flow.parsed.slo
            out.append(DecodeRequestInfo(
                rid=flow.client_id, instance_id=moving[1] if moving else attempt.decode.instance_id,
                input_tokens=flow.parsed.input_tokens, generated_tokens=flow.delivered_tokens,
                max_output_tokens=flow.parsed.max_tokens, arrived_unix_s=flow.arrived_unix,
                slo_tpot_s=slo.tpot_s if slo is not None else None,
                predicted_remaining_tokens=flow.predicted_remaining(),
                migrating=moving is not None, migration_source_id=moving[0] if moving else None))
        return out

    async def _on_requests_query(self, query: GatewayRequestsQuery) -> GatewayRequests:
        return GatewayRequests(gateway=self.move_token, requests=self.movable_requests())

    async def move(self, rid: str, target_id: str, mechanism: str, timeout_s: float | None = None) -> MoveResult:
        """Move request ``rid`` to decode instance ``target_id``; returns once the target streams or it failed."""
        flow = self.flows.get(rid)
        if flow is None:
            return MoveResult(False, f"no request {rid!r} in flight on this gateway")
        why_not = flow.moves.movable()
        if why_not is not None:
            return MoveResult(False, why_not)
        try:
            done = flow.moves.request(target_id, mechanism)
        except ValueError as exc:
            return MoveResult(False, str(exc))
        timeout = timeout_s if timeout_s is not None else self.settings.first_token_timeout_s + 5.0
        try:
            result = await asyncio.wait_for(asyncio.shield(done), timeout)
        except TimeoutError:
            return MoveResult(False, f"no outcome within {timeout:.0f}s (the stream may be stalled)")
        if not result.ok:
            self.metrics.migration_failures.inc()
        elif result.stall_s is not None:
            self.metrics.migration_stall.observe(result.stall_s)
        return result

    async def _on_move(self, cmd: MoveCommand) -> MoveReply:
        result = await self.move(cmd.rid, cmd.target_id, cmd.mechanism)
        if result.ok:
            log.info("moved %s to %s (%s)%s", cmd.rid, result.target_id, result.mechanism,
                     f": {cmd.reason}" if cmd.reason else "")
        return MoveReply(ok=result.ok, message=result.message, rid=cmd.rid, mechanism=result.mechanism,
                         source_id=result.source_id, target_id=result.target_id, stall_s=result.stall_s)

    def finish(self, flow: RequestFlow, *, status: str = "ok", error: str | None = None) -> None:
        """End a request: settle and record it now, abort/close its legs in a task of the service's own.

        Called from ``finally`` blocks that may run inside a cancelled task; nothing here awaits, so the
        abort reaches the engines even when the client's task is gone.
        """
        attempt = flow.conclude(status=status, error=error)
        self.flows.pop(flow.client_id, None)
        self.metrics.inflight.dec()
        self.record(flow)
        if attempt is not None:
            self.spawn(flow.cleanup(attempt))

    def spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        task = asyncio.create_task(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

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
                error=o.error, cached_tokens=o.cached_tokens,
            )
            self._events.append(event)

    async def _stall_watch_loop(self) -> None:
        """Find engines that stopped making progress (SIGSTOPped, hung, their GPU wedged).

        One sweep over the requests in flight every quarter of ``stall_timeout_s`` (at most 1 s), not a
        timer per token. A decode stream is judged only while the gateway waits on it, after its first token:
        one that went ``stall_timeout_s`` without a token is given up, and its flow rescues it on another pair.
        Before the first token a long wait is no sign by itself (a deep prefill queue is one too), so the
        engines a request has waited on that long are asked whether they still work (``_probe``, at most once
        per ``stall_timeout_s`` each); the requests waiting on one that does not answer go to another pair.
        """
        timeout = self.settings.stall_timeout_s
        while True:
            await asyncio.sleep(min(1.0, timeout / 4))
            now = time.monotonic()
            for flow in list(self.flows.values()):
                attempt = flow.attempt
                if attempt is None or flow.moves.moving is not None:
                    continue
                idle = now - attempt.last_event_at
                if idle <= timeout:
                    continue
                if flow.outcome.first_token_at is None:
                    for engine in (attempt.prefill, attempt.decode):
                        if engine is not None and now - self._probed_at.get(engine.instance_id, -math.inf) > timeout:
                            self._probed_at[engine.instance_id] = now
                            self._probe(engine, f"gave no first token in {idle:.0f} s")
                elif attempt.reading:
                    reason = f"no token from {attempt.decode.instance_id} for {idle:.1f}s: the decode engine stalled"
                    log.warning("request %s: %s; resuming it elsewhere", flow.client_id, reason)
                    self.metrics.stalls.inc()
                    attempt.give_up_stalled(reason)

    async def _flush_events_loop(self) -> None:
        while True:
            await asyncio.sleep(EVENT_FLUSH_INTERVAL_S)
            await self._flush_events()

    async def _flush_events(self) -> None:
        if not self._events or self.bus is None or not self.bus.is_connected:
            return
        events, self._events = self._events, []
        try:
            await self.bus.publish(self.subjects.request_events(), RequestEventBatch(gateway=self.replica_id, events=events))
        except Exception as exc:  # telemetry must never fail a request; the monitor just misses a batch
            log.warning("could not publish %d request events: %s", len(events), exc)

    def _status(self) -> ServiceStatus:
        return ServiceStatus(
            service="gateway", replica_id=self.replica_id, is_leader=True, policy=self.policy.name,
            policy_note="dispatch: least pending prompt tokens (prefill), least KV use (decode)",
            uptime_s=time.monotonic() - self._started_at,
            details={"inflight": self.cluster.inflight_total(), "instances": len(self.cluster.instances),
                     "late_binding": (f"{self.settings.late_binding_policy} depth {self.settings.late_binding_depth}"
                                      if self.settings.late_binding else "off"),
                     "late_binding_held": self.admission.held,
                     "slo_classes": sorted(self.slo_table.classes),
                     "listen": f"{self.settings.host}:{self.settings.port}", "token_counter": getattr(self.counter, "name", "")},
        )
