"""Early rejection: refuse a request at dispatch (a retryable 429) when the decode side cannot start it within
its TTFT target, rather than queue it behind a backlog it would wait out only to be late (Mooncake's Conductor
rejects early on a predicted SLO miss; see ../shared/anchors.md).

Why a disaggregated cluster needs it: SGLang's decode engine reserves a request's KV before its prefill may
start (the prealloc queue), first come first served. Past the decode side's capacity that queue grows without
bound and every request waits behind all of it, so the cluster goes from serving everything in time to
serving almost nothing within a few percent more load: a fixed 5P3D on the Mooncake conversation trace holds
100% of requests in time at 2x its rate and 5% at 2.125x, its prealloc queues near 500 requests each by the
end of the hour (`poise sim --trace mooncake-conv --policy static-minload --split 5P3D --prefill-policy
flowprefill-fewest-late --preemption operator --chunk 0 --rate-scale 2.125 --warmup-s 120`; the curves with
and without the rule: tests/bench/results/early_rejection.md). Refusing the requests that would wait past their target keeps the
queue at what the engines serve in time, and the rest of the requests in time.

The estimate is measured, not modelled: an engine's queue of requests that a new one would wait behind (a
decode engine's requests waiting for KV, ``EngineView.kv_waiting_reqs``: SGLang's prealloc and retracted
queues; a colocated engine's waiting queue, ``EngineView.waiting_reqs``: prompts not yet admitted to a
prefill batch, which it admits as KV and the chunk budget free) over the rate at which requests recently left
it (``EngineView.finish_rate_rps``, counted by the dispatcher). A queue that lasts is one the engine's KV or
compute holds back, and requests then enter at the rate they leave. A queue is judged only once it has
lasted ``persist_s``: a burst that arrives between two steps of an engine with free KV is admitted at the
next step, whatever the rate says (Azure code at 3x, a fifth of its goodput: 20 requests at one instant,
4 in a prealloc queue with 5% of the KV in use). The wait is a lower bound on the TTFT (the prefill and the
KV copy come after it).

:class:`EarlyRejection` wraps any dispatch policy, like :class:`shared.policies.local_prefill.LocalPrefill`:
the inner policy places the request; when its decode (or colocated) engine's wait is past the target, another
open engine of the same role that can start it in time takes it, and when none can, the request is refused.
Colocated engines are judged like decode ones: past their capacity a colocated cluster otherwise queues
every request behind the whole backlog, as a split's decode side does (tests/bench/results/provenance.md, "What the
gateway's rules changed about the modes"). Not where they give up late prompts themselves
(``EarlyRejectionParams.colocated``; Poise's engines): their fewest-late order keeps the prompts that can make
their targets, and the queue's length over the finish rate then overstates the wait of a prompt it keeps
(tests/bench/results/provenance.md, "Early rejection and colocated engines that give up late prompts").
"""

from __future__ import annotations

from collections.abc import Sequence

import msgspec

from shared.policies.dispatch import DispatchPolicy, Placement, Rejection
from shared.policies.views import EngineView, RequestView


class EarlyRejectionParams(msgspec.Struct, frozen=True, kw_only=True):
    # Refuse when the decode wait passes this many times the request's TTFT target: 1 refuses only requests
    # the wait alone makes late, and lets a passing burst queue up to the whole target.
    factor: float = 1.0
    # ... and this many times once the queue is standing: it rose past standing_factor x the default target
    # (the policy's ttft_slo_s; requests with targets of their own share one queue) and has not drained (below
    # min_queue) for standing_s. A standing queue sits at the refusal line, so every
    # request taken waits about that long; half the target leaves the other half for its prefill, its KV
    # copy and the estimate's error. (CoDel's split between a good queue, which drains within an interval,
    # and a bad one, which does not.)
    standing_factor: float = 0.5
    standing_s: float = 30.0
    # A queue shorter than this is never judged: a handful of waiting requests is the ordinary churn of a
    # full engine, and a rate read then says little.
    min_queue: int = 4
    # ... nor one that has not lasted this long (seen at min_queue or more at every dispatch since).
    persist_s: float = 1.0
    # Judge colocated engines too (their waiting queue). Off where they refuse late prompts themselves
    # (``give_up_late``): the fewest-late order then keeps the prompts that can make it, and the queue's
    # length over the finish rate overstates the wait of a prompt it would keep.
    colocated: bool = True

    def __post_init__(self) -> None:
        if self.factor <= 0 or self.standing_factor <= 0:
            raise ValueError("factor and standing_factor must be > 0")
        if self.standing_s < 0 or self.persist_s < 0:
            raise ValueError("standing_s and persist_s must be >= 0")
        if self.min_queue < 1:
            raise ValueError("min_queue must be >= 1")


#: The roles early rejection judges (the engines a request's decode runs on): how a refusal names the engine
#: and what its queue waits for.
_JUDGED: dict[str, tuple[str, str]] = {"decode": ("decode", "for KV"), "null": ("colocated", "to start")}


def queued_ahead(engine: EngineView) -> int:
    """The requests a new one sent to ``engine`` waits behind before it starts: a decode engine's requests
    waiting for KV, a colocated engine's waiting queue (0 for any other role)."""
    if engine.role == "decode":
        return engine.kv_waiting_reqs
    return engine.waiting_reqs if engine.role == "null" else 0


def decode_wait_s(engine: EngineView, params: EarlyRejectionParams) -> float | None:
    """How long a request sent to ``engine`` now waits to start (:func:`queued_ahead` at its finish rate): 0
    with a short queue, None (nothing to judge on) when the queue is long but the rate is not known yet."""
    queued = queued_ahead(engine)
    if queued < params.min_queue:
        return 0.0
    rate = engine.finish_rate_rps
    if rate is None or rate <= 0:
        return None
    return queued / rate


class EarlyRejection:
    """A dispatch policy that refuses requests its decode side cannot start in time (see the module doc)."""

    def __init__(self, inner: DispatchPolicy, ttft_slo_s: float, params: EarlyRejectionParams | None = None) -> None:
        self.inner = inner
        self.ttft_slo_s = ttft_slo_s  # the target of requests that carry none of their own
        self.params = params or EarlyRejectionParams()
        self.name = f"{inner.name}+early-rejection"
        self._queued_at: dict[str, float] = {}  # decode engines with a queue of min_queue or more: since when
        self._rose_at: dict[str, float] = {}  # decode engines whose queue rose past the standing line: since when

    def __getattr__(self, name: str) -> object:
        # The inner policy's extras (Arrow's observe_prefill, its predictors) stay reachable.
        return getattr(self.inner, name)

    def place(self, request: RequestView, engines: Sequence[EngineView], now_s: float,
              exclude: frozenset[str] = frozenset()) -> Placement | Rejection:
        decision = self.inner.place(request, engines, now_s, exclude)
        if not isinstance(decision, Placement):
            return decision
        decode = next((e for e in engines if e.instance_id == decision.decode_id), None)
        if decode is None or decode.role not in _JUDGED or (decode.role == "null" and not self.params.colocated):
            return decision
        target = request.slo_ttft_s or self.ttft_slo_s
        wait = self._wait_s(decode, now_s)
        if wait is None or wait <= target * self._factor(decode.instance_id, wait, now_s):
            return decision
        # The inner policy ranks engines by load, not by queue: another of the role may start the request in
        # time. A request prefilled on its decode engine (no prefill_id) may move only to one that prefills too.
        best: tuple[float, str] | None = None
        for e in engines:
            if (e.role != decode.role or not e.accepting or e.instance_id in exclude or e is decode
                    or (decode.role == "decode" and decision.prefill_id is None and not e.local_prefill)):
                continue
            w = self._wait_s(e, now_s)
            if (w is not None and w <= target * self._factor(e.instance_id, w, now_s)
                    and (best is None or (w, e.instance_id) < best)):
                best = (w, e.instance_id)
        if best is not None:
            return Placement(prefill_id=decision.prefill_id, decode_id=best[1], stages=(*decision.stages, "redirected"))
        assert decode.finish_rate_rps is not None  # a judged wait has a rate
        kind, waits_for = _JUDGED[decode.role]
        return Rejection(
            reason=(f"early rejection: {kind} engine {decode.instance_id} has "
                    f"{queued_ahead(decode)} requests waiting {waits_for} and serves "
                    f"{decode.finish_rate_rps:.2f}/s, so this request would wait about "
                    f"{wait:.0f} s to start, too long for its TTFT target of {target:.1f} s; retry later"),
            retryable=True, code="slo_unreachable")

    def _wait_s(self, engine: EngineView, now_s: float) -> float | None:
        """:func:`decode_wait_s`; None too while the engine's queue has not lasted ``persist_s``."""
        wait = decode_wait_s(engine, self.params)
        if wait == 0:
            self._queued_at.pop(engine.instance_id, None)
            return wait
        if now_s - self._queued_at.setdefault(engine.instance_id, now_s) < self.params.persist_s:
            return None
        return wait

    def _factor(self, instance_id: str, wait: float, now_s: float) -> float:
        """The share of the TTFT target a request may wait for ``instance_id``'s KV, its queue's standing
        updated from ``wait`` (what it is now)."""
        params = self.params
        if wait <= 0:  # drained
            self._rose_at.pop(instance_id, None)
            return params.factor
        if wait > params.standing_factor * self.ttft_slo_s:
            rose = self._rose_at.setdefault(instance_id, now_s)
        else:
            rose = self._rose_at.get(instance_id, now_s)
        return params.standing_factor if now_s - rose >= params.standing_s else params.factor
