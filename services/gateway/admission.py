"""The gateway's admission: the asyncio adapter of the gateway model (shared/gateway/model.py).

Every request is admitted through :class:`Admission`: the model places it at once, refuses it, or, with
``late_binding`` on, holds it until a prefill engine of its model has fewer than ``late_binding_depth``
prompts this gateway sent and that are not prefilled yet, in ``late_binding_policy``'s order (for engines
whose scheduler cannot be patched: the order in which prompts reach the engines is then the policy's; a
prompt already on an engine is not preempted). With the gateway's early rejection on, the held queue also
guards the decode side and gives up a request held past its TTFT target (a retryable 429,
``slo_unreachable``).

What this module adds to the model is what only a live gateway has: a future per request that its task
awaits, resolved with the placement or the refusal (as an :class:`APIError`); a timer for the model's
wake-ups; the metrics. The queue is pumped when a request arrives (at once: an idle engine takes it without a
loop turn), when a prefill slot frees or a request ends (the cluster view's ``on_release``), when the
instances change and at the model's wake-up time. A client that disconnects (or times out) while held is
withdrawn from the queue.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from services.gateway.cluster import ClusterView
from services.gateway.errors import APIError
from services.gateway.metrics import GatewayMetrics
from shared.gateway.model import GatewayModel, Refusal
from shared.policies import EngineView, Placement, RequestView
from shared.protocol.messages import Role
from shared.protocol.refusal import retry_after_header

log = logging.getLogger(__name__)


@dataclass(eq=False, slots=True)
class Ticket:
    """One request's admission; read by the late-binding prefill policy as a :class:`PrefillItem`."""

    request: RequestView  # what the dispatch policy reads (its rid: the request's key in the ledger)
    model: str
    arrival_s: float  # the gateway's monotonic clock (when the request reached the gateway)
    slo_ttft_s: float = math.inf  # inf: no TTFT target
    prefilled: int = 0
    retries: int = 0  # the client's earlier sends of this request (X-Stainless-Retry-Count)
    # Resolved with the placement or the refusal (made on the running loop: build it inside a coroutine).
    future: asyncio.Future[Placement] = field(default_factory=lambda: asyncio.get_running_loop().create_future())

    @property
    def rid(self) -> str:
        return self.request.rid

    @property
    def input_tokens(self) -> int:
        return self.request.input_tokens


def refusal_error(refusal: Refusal) -> APIError:
    """What the client gets for a refusal: a 429 with Retry-After (come back later) or a 503."""
    if refusal.status == 429:
        return APIError(429, refusal.reason, type_="rate_limit_error", code=refusal.code,
                        headers=retry_after_header())
    return APIError(refusal.status, refusal.reason, type_="service_unavailable", code=refusal.code)


class Admission:
    def __init__(self, model: GatewayModel[Ticket], cluster: ClusterView, metrics: GatewayMetrics) -> None:
        self.model = model
        self.cluster = cluster
        self.metrics = metrics
        self._scheduled = False
        self._timer: asyncio.TimerHandle | None = None
        self._timer_at = math.inf
        cluster.on_release = self.kick

    @property
    def held(self) -> int:
        return self.model.held_count()

    async def admit(self, ticket: Ticket) -> Placement:
        """Wait for the request's turn and place it (its engines' slots taken); returns the placement or raises
        the refusal's :class:`APIError`. Cancellation withdraws the request from the queue."""
        held = self.model.late_binding is not None
        try:
            self._arm(self.model.admit(ticket, ticket.model, time.monotonic(), self))
            self._gauge()
            return await ticket.future
        finally:
            if self.model.withdraw(ticket):  # cancelled (client gone, timeout) while held
                self._gauge()
            if not ticket.future.done():
                ticket.future.cancel()
            if ticket.future.cancelled():
                self.kick()  # its slot, if it had been granted one, is released by the flow; look again
            elif held:
                self.metrics.late_binding_wait.observe(time.monotonic() - ticket.arrival_s)

    def place(self, ticket: Ticket, exclude: frozenset[str]) -> Placement:
        """Place the request again at once, never on ``exclude`` (a retry after a failed leg: it already waited
        its turn); raises the refusal's :class:`APIError`."""
        decision = self.model.place(ticket, ticket.model, time.monotonic(), self, exclude)
        if isinstance(decision, Refusal):
            raise refusal_error(decision)
        assert decision is not None  # this adapter sends every placement
        return decision

    def kick(self) -> None:
        """Something changed (a slot freed, instances changed, a timer fired): pump on the next loop turn."""
        if self._scheduled or not self.model.held_count():
            return
        self._scheduled = True
        asyncio.get_running_loop().call_soon(self._pump_all)

    def close(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    # -- the model's port ------------------------------------------------------------------------------
    def engines(self, model: str, role: Role | None = None) -> Sequence[EngineView]:
        engines = self.cluster.engines(model)
        return engines if role is None else [e for e in engines if e.role == role]

    def accepting(self, model: str, role: Role) -> Sequence[str]:
        return [e.instance_id for e in self.cluster.engines(model) if e.role == role and e.accepting]

    def request(self, item: Ticket) -> RequestView:
        return item.request

    def placed(self, item: Ticket, placement: Placement) -> bool:
        if item.future.cancelled():  # its client left while it was held; its task has not withdrawn it yet
            self.cluster.release(item.rid)
            return False
        for stage in placement.stages:
            self.metrics.placement_stages.labels(stage).inc()
        if not item.future.done():  # done: a retry's placement (place), returned to the caller
            item.future.set_result(placement)
        return True

    def refused(self, item: Ticket, refusal: Refusal) -> None:
        self.metrics.rejections.labels(refusal.code).inc()
        if not item.future.done():
            item.future.set_exception(refusal_error(refusal))

    # -- internals ---------------------------------------------------------------------------------
    def _gauge(self) -> None:
        self.metrics.late_binding_held.set(self.held)

    def _pump_all(self) -> None:
        self._scheduled = False
        self._arm(self.model.pump_all(time.monotonic(), self))
        self._gauge()

    def _on_timer(self) -> None:
        self._timer, self._timer_at = None, math.inf
        self._pump_all()

    def _arm(self, at_s: float) -> None:
        if at_s >= self._timer_at or math.isinf(at_s):
            return
        if self._timer is not None:
            self._timer.cancel()
        self._timer_at = at_s
        self._timer = asyncio.get_running_loop().call_later(max(0.0, at_s - time.monotonic()), self._on_timer)
