"""The gateway's late-binding prefill queue, for engines whose scheduler cannot be patched (stock SGLang).

With ``late_binding`` on, a request that would go to a prefill engine first waits here. It is dispatched
(the dispatch policy still picks the pair) only while some prefill engine of its model has fewer than
``late_binding_depth`` prompts that this gateway sent and that are not prefilled yet (the cluster view's
in-flight count of that engine, released when the prompt's prefill leg answers or its first token arrives),
and the held requests go in the order of ``late_binding_policy``, a prefill policy
(:class:`shared.policies.late_binding.LateBinding`, the same objects engine_sim and the simulator run). So the
order in which prompts reach the engines is the policy's, not arrival order; a prompt already on an engine is
not preempted.

The queue's rule is one pure pump (:meth:`shared.policies.late_binding.LateBinding.pump`, which the simulator
runs too); this module is its asyncio adapter: futures the waiting requests await, a timer for the pump's
wake-ups, the metrics. The queue is pumped when a request arrives, when a prefill slot frees, when the instances change and at a
policy's ``retry_at_s`` (a batching policy that chose to wait). A released request is placed and its engine
slots taken in the same synchronous step, so the counts the next decision reads are exact. A request whose
model has no accepting prefill engine is not held (it is placed as without late binding: a colocated engine,
or the same error as without late binding); held requests are let go the same way when their model's last
prefill engine leaves. A client that disconnects (or times out) while held is just removed.

With the gateway's early rejection on, the queue guards the decode side too (``LateBinding.guard_decode``):
nothing is released while no decode engine of the model runs and queues fewer requests than its cap (as
its load reports say), and a request held past its TTFT target is refused with early rejection's retryable
429 (``slo_unreachable``). The queue is pumped again when a request ends (its slots are released), so a
decode engine with room again takes the next one.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from services.gateway.cluster import ClusterView
from services.gateway.errors import APIError
from services.gateway.metrics import GatewayMetrics
from shared.policies import Placement
from shared.policies.late_binding import LateBinding
from shared.protocol.refusal import retry_after_header

log = logging.getLogger(__name__)

PlaceFn = Callable[[frozenset[str]], Placement]


@dataclass(eq=False, slots=True)
class HeldRequest:
    """A request waiting for a prefill slot; read by the prefill policy as a :class:`PrefillItem`."""

    rid: str
    model: str
    arrival_s: float  # the gateway's monotonic clock (when the request reached the gateway)
    input_tokens: int
    slo_ttft_s: float = math.inf  # inf: no TTFT target
    prefilled: int = 0
    place: PlaceFn | None = None  # places the request and takes its engines' slots (raises APIError)
    # Resolved with the placement when released (made on the running loop: build it inside a coroutine).
    future: asyncio.Future[Placement] = field(default_factory=lambda: asyncio.get_running_loop().create_future())


class LateBindingQueue:
    def __init__(self, binding: LateBinding, cluster: ClusterView, metrics: GatewayMetrics) -> None:
        self.binding = binding
        self.cluster = cluster
        self.metrics = metrics
        self._held: dict[str, list[HeldRequest]] = {}  # model -> held requests, in arrival order
        self._scheduled = False
        self._timer: asyncio.TimerHandle | None = None
        self._timer_at = math.inf

    @property
    def held(self) -> int:
        return sum(len(v) for v in self._held.values())

    async def admit(self, item: HeldRequest, place: PlaceFn) -> Placement:
        """Wait for the request's turn, then place it with ``place`` (which takes the slots); returns the
        placement or raises what ``place`` raised. Cancellation removes the request from the queue."""
        if not any(e.role == "prefill" and e.accepting for e in self.cluster.engines(item.model)):
            return place(frozenset())  # nothing to bind late to: as without late binding
        item.place = place
        held = self._held.setdefault(item.model, [])
        held.append(item)
        self._gauge()
        try:
            self._pump(item.model)  # an idle engine takes it at once, without a loop turn
            return await item.future
        finally:
            if item in held:  # cancelled (client gone, timeout) while held
                held.remove(item)
                self._gauge()
            if not held and self._held.get(item.model) is held:
                del self._held[item.model]
            if not item.future.done():
                item.future.cancel()
            if item.future.cancelled():
                self.kick()  # its slot, if it had been granted one, is released by the flow; look again
            else:
                self.metrics.late_binding_wait.observe(time.monotonic() - item.arrival_s)

    def kick(self) -> None:
        """Something changed (a slot freed, instances changed, a timer fired): pump on the next loop turn."""
        if self._scheduled or not self._held:
            return
        self._scheduled = True
        asyncio.get_running_loop().call_soon(self._pump_all)

    def close(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    # -- internals ---------------------------------------------------------------------------------
    def _gauge(self) -> None:
        self.metrics.late_binding_held.set(self.held)

    def _pump_all(self) -> None:
        self._scheduled = False
        for model in list(self._held):
            self._pump(model)

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

    def _pump(self, model: str) -> None:
        held = self._held.get(model)
        if not held:
            return
        held[:] = [h for h in held if not h.future.done()]  # cancelled, not yet cleaned up by their task
        now = time.monotonic()
        engines = self.cluster.engines(model)
        prefill = {e.instance_id: e.inflight_reqs for e in engines if e.role == "prefill" and e.accepting}
        pumped = self.binding.pump(held, prefill, engines, now, self._dispatch)
        for item in pumped.refused:
            self.metrics.rejections.labels("slo_unreachable").inc()
            item.future.set_exception(APIError(
                429, self.binding.give_up_reason(now - item.arrival_s, item.slo_ttft_s),
                type_="rate_limit_error", code="slo_unreachable", headers=retry_after_header()))
        self._arm(pumped.wake_at_s)
        self._gauge()

    @staticmethod
    def _dispatch(item: HeldRequest, exclude: frozenset[str]) -> str | None:
        """Place a released request (taking its slots) and wake its task; the prefill engine it took a slot on."""
        assert item.place is not None
        try:
            placement = item.place(exclude)
        except Exception as exc:  # APIError (429/503) goes to the waiting request as it would without the queue
            item.future.set_exception(exc)
            return None
        item.future.set_result(placement)
        return placement.prefill_id
