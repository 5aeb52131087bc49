"""The gateway's admission as one pure, clock-free model: the held queue, placement and the in-flight ledger.

A request that reaches the gateway is, in this order of stages:

- **held** (late binding, :class:`shared.policies.late_binding.LateBinding`): it waits in the gateway until a
  prefill engine of its model has room, and the held requests go in the prefill policy's order;
- **given up**: held past its TTFT target while the decode side had no room (the queue's ``guard_decode``),
  it is refused with a retryable 429;
- **placed** by the dispatch policy (least load, Arrow, and the stages a wrapping policy adds: DOPD's local
  prefill, early rejection's redirect, both named in :attr:`Placement.stages`), or **refused** by it (429 when
  every engine is full or the SLO cannot be met, 503 when nothing can serve the model).

Every placement takes its engines' share of the in-flight ledger (:class:`InflightLedger`) in the same step,
so the next decision reads exact counts; the first token, the prefill's end and the request's end give it
back. The model holds no clock and does no I/O: an adapter hands it the time and a :class:`Port` through
which it reads engine views and carries out each decision, synchronously and in order. The live gateway's
adapter is services/gateway/admission.py (futures the requests await, a timer, metrics), the simulator's
loadgen/sim/cluster.py (events on the simulated clock), so a request meets the same rules in both.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Generic, Protocol, TypeVar

import msgspec

from shared.policies.dispatch import DispatchPolicy, Placement, Rejection
from shared.policies.inflight import InflightLedger
from shared.policies.late_binding import HeldItem, LateBinding
from shared.policies.views import EngineView, RequestView
from shared.protocol.messages import Role

T = TypeVar("T", bound=HeldItem)
T_contra = TypeVar("T_contra", bound=HeldItem, contravariant=True)


class Refusal(msgspec.Struct, frozen=True, kw_only=True):
    """A request the gateway will not serve now, as the client is told (an OpenAI-style error)."""

    status: int  # 429: come back later (with Retry-After); 503: nothing serves the request's model now
    code: str  # overloaded | slo_unreachable | no_capacity
    reason: str
    given_up: bool = False  # held past its TTFT target (late binding), not refused by the dispatch policy

    @classmethod
    def of(cls, rejection: Rejection) -> Refusal:
        if rejection.retryable:
            return cls(status=429, code=rejection.code, reason=rejection.reason)
        return cls(status=503, code="no_capacity", reason=rejection.reason)


class Port(Protocol[T_contra]):
    """What the model asks of its adapter; each call is synchronous, and each decision carried out before the
    next is made (a placement changes the views the next one reads)."""

    def engines(self, model: str, role: Role | None = None) -> Sequence[EngineView]:
        """The engines serving ``model`` (of ``role``, or all), as the dispatcher sees them now (with the
        ledger's in-flight work)."""
        ...

    def accepting(self, model: str, role: Role) -> Sequence[str]:
        """The engines of ``role`` serving ``model`` that take requests now (ready and healthy): what the held
        queue binds to, without building their views (the simulator pumps on every prefill's end)."""
        ...

    def request(self, item: T_contra) -> RequestView:
        """What the dispatch policy reads of ``item``; its ``rid`` is the request's key in the ledger."""
        ...

    def placed(self, item: T_contra, placement: Placement) -> bool:
        """Send ``item`` where it was placed. False: it could not go after all (the adapter failed it and gave
        its ledger hold back), so it takes no prefill slot."""
        ...

    def refused(self, item: T_contra, refusal: Refusal) -> None:
        """Tell ``item``'s client it is refused."""
        ...


class GatewayModel(Generic[T]):
    """Admission for one gateway: ``late_binding`` None sends every request on at once."""

    def __init__(self, policy: DispatchPolicy, late_binding: LateBinding | None = None,
                 ledger: InflightLedger | None = None) -> None:
        self.policy = policy
        self.late_binding = late_binding
        self.ledger = ledger if ledger is not None else InflightLedger()
        self._held: dict[str, list[T]] = {}  # model -> held requests, in arrival order

    # -- arrivals and the held queue -----------------------------------------------------------------
    def admit(self, item: T, model: str, now_s: float, port: Port[T]) -> float:
        """A request for ``model`` arrived: placed or refused now, or held. Returns when to :meth:`pump` again
        at the latest (inf: only when something changes)."""
        if self.late_binding is None:
            self.place(item, model, now_s, port)
            return math.inf
        self.hold(item, model)
        return self.pump(model, now_s, port)

    def hold(self, item: T, model: str) -> None:
        """Queue ``item`` without pumping (an adapter inside a pump already, which pumps again after it)."""
        self._held.setdefault(model, []).append(item)

    def pump(self, model: str, now_s: float, port: Port[T]) -> float:
        """Release what may go now, give up what waited too long; returns when to pump again at the latest.

        Pump when a request arrives, a prefill slot frees (a prefill's end, a first token), a request ends (its
        decode engine has room again), the engines change, and at the time returned."""
        held = self._held.get(model)
        lb = self.late_binding
        if not held or lb is None:
            return math.inf
        # Without an accepting prefill engine there is nothing to bind to: every held prompt is placed as
        # without late binding (a colocated engine, or the dispatch policy's refusal).
        prefill = {i: self.ledger.engine(i).reqs for i in port.accepting(model, "prefill")}
        decode = port.engines(model, "decode") if lb.guard_decode and prefill else ()  # what decode_room reads

        def release(item: T, full: frozenset[str]) -> str | None:
            decision = self.place(item, model, now_s, port, full)
            return decision.prefill_id if isinstance(decision, Placement) else None

        pumped = lb.pump(held, prefill, decode, now_s, release)
        for item in pumped.refused:
            port.refused(item, Refusal(status=429, code="slo_unreachable", given_up=True,
                                       reason=lb.give_up_reason(now_s - item.arrival_s, item.slo_ttft_s)))
        if not held:
            self._held.pop(model, None)
            return math.inf
        return pumped.wake_at_s

    def pump_all(self, now_s: float, port: Port[T]) -> float:
        """:meth:`pump` every model's queue; the earliest time to pump again."""
        return min((self.pump(model, now_s, port) for model in list(self._held)), default=math.inf)

    def withdraw(self, item: T) -> bool:
        """Take a held request out of the queue (its client is gone); False when it was not held."""
        for model, held in self._held.items():
            if any(h is item for h in held):
                held[:] = [h for h in held if h is not item]
                if not held:
                    del self._held[model]
                return True
        return False

    def held_count(self) -> int:
        """How many requests are held (cheap: the adapters ask on every prefill's end and every release)."""
        return sum(len(held) for held in self._held.values())

    def held(self, model: str | None = None) -> list[T]:
        """The held requests (of ``model``, or all), in arrival order."""
        if model is not None:
            return list(self._held.get(model, ()))
        return [h for held in self._held.values() for h in held]

    # -- placement -------------------------------------------------------------------------------------
    def place(self, item: T, model: str, now_s: float, port: Port[T],
              exclude: frozenset[str] = frozenset()) -> Placement | Refusal | None:
        """Place ``item`` now, never on the engines in ``exclude`` (full, or failed it already), take its
        ledger holds and carry the decision out through ``port``; returns the decision (None: placed, but the
        adapter could not send it). Outside the queue: a retry on other engines goes here directly."""
        request = port.request(item)
        decision = self.policy.place(request, port.engines(model), now_s, exclude)
        if isinstance(decision, Placement):
            self.ledger.dispatched(request.rid, decision.decode_id, decision.prefill_id, request.input_tokens,
                                   request.max_output_tokens)
            return decision if port.placed(item, decision) else None
        refusal = Refusal.of(decision)
        port.refused(item, refusal)
        return refusal
