"""Dispatch policies: pick the prefill and the decode engine for one request.

A policy is pure: ``place(request, engines, now_s, exclude)`` returns a :class:`Placement` or a
:class:`Rejection`, never raises for ordinary overload. ``exclude`` holds engines that already failed this
request (the gateway retries once on another pair). Arrow's SLO-aware dispatch (shared/policies/arrow.py) implements
the same Protocol.

Colocated (``null``) engines serve a request alone. With no prefill/decode pair they take every request;
beside pairs (a cluster moving between disaggregated and colocated serving, see shared/policies/poise.py)
they take their share of the requests, one per instance, by :class:`ColocatedShare`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple, Protocol

import msgspec

from shared.policies.views import EngineView, RequestView


class Placement(msgspec.Struct, frozen=True, kw_only=True):
    """Where a request goes. ``prefill_id`` is None when ``decode_id`` prefills the request itself: a colocated
    engine, or a decode engine doing DOPD's local prefill (shared/policies/local_prefill.py)."""

    prefill_id: str | None
    decode_id: str
    # What a wrapping policy changed, in order, as the gateway's metrics and the simulator's report count it:
    # "local-prefill" (kept on its decode engine: local_prefill.py), "redirected" (moved to a decode engine that
    # starts it in time: admission.py).
    stages: tuple[str, ...] = ()


class Rejection(msgspec.Struct, frozen=True, kw_only=True):
    """No engine can take the request. ``retryable``: overload (429) vs nothing to route to (503). ``code``
    names a retryable refusal's cause (the OpenAI-style error code and the gateway's rejection metric label):
    ``overloaded`` (every engine at its queue limit) or ``slo_unreachable`` (shared/policies/admission.py)."""

    reason: str
    retryable: bool
    code: str = "overloaded"


class DispatchPolicy(Protocol):
    name: str

    def place(
        self, request: RequestView, engines: Sequence[EngineView], now_s: float, exclude: frozenset[str] = frozenset()
    ) -> Placement | Rejection: ...


class DispatchParams(msgspec.Struct, frozen=True, kw_only=True):
    max_pending_per_engine: int = 512  # queued + in flight beyond which an engine is full (-> 429)
    stale_load_s: float = 5.0  # a load report older than this is ignored (engine counted by in-flight only)


def _pending(e: EngineView, params: DispatchParams) -> int:
    fresh = e.load_age_s is not None and e.load_age_s <= params.stale_load_s
    reported = e.waiting_reqs + e.queue_reqs if fresh else 0
    # The report lags by up to one interval while the in-flight count is exact: trust the larger.
    return max(reported, e.inflight_reqs)


class OpenEngines(NamedTuple):
    """The accepting engines of each role that are not full, and how many accepting ones were full."""

    prefill: list[EngineView]
    decode: list[EngineView]
    colocated: list[EngineView]
    full: int


def open_engines(engines: Sequence[EngineView], exclude: frozenset[str], params: DispatchParams) -> OpenEngines:
    """:class:`OpenEngines` of ``engines`` (in their order), in one pass: every dispatch reads every engine."""
    by_role: dict[str, list[EngineView]] = {"prefill": [], "decode": [], "null": []}
    full = 0
    limit = params.max_pending_per_engine
    for e in engines:
        group = by_role.get(e.role)
        if group is None or not e.accepting or e.instance_id in exclude:
            continue
        if _pending(e, params) < limit:
            group.append(e)
        else:
            full += 1
    return OpenEngines(by_role["prefill"], by_role["decode"], by_role["null"], full)


def rejection(engines: Sequence[EngineView], full: int) -> Rejection:
    if full:
        return Rejection(reason=f"all {full} engine(s) that could serve this request are at their queue limit", retryable=True)
    roles = sorted({e.role for e in engines if e.accepting})
    have = ", ".join(roles) if roles else "none"
    return Rejection(reason=f"no ready prefill+decode pair or colocated engine (ready roles: {have})", retryable=False)


class ColocatedShare:
    """Which requests go to colocated engines while prefill/decode pairs serve beside them: each instance
    takes an equal share of the requests (a pair's two instances two shares), spread evenly in arrival order
    (deterministic, no draws)."""

    def __init__(self) -> None:
        self._credit = 0.0

    def take(self, colocated: int, paired: int) -> bool:
        """True when this request goes to a colocated engine (``colocated`` of them open, ``paired`` prefill
        and decode engines open)."""
        if colocated <= 0:
            return False
        if paired <= 0:
            return True
        self._credit += colocated / (colocated + paired)
        if self._credit >= 1.0:
            self._credit -= 1.0
            return True
        return False


class _PairPolicy:
    """Shared shape: choose a prefill and a decode independently, fall back to colocated engines."""

    name = "base"

    def __init__(self, params: DispatchParams | None = None) -> None:
        self.params = params or DispatchParams()
        self.share = ColocatedShare()

    def _pick(self, candidates: list[EngineView], phase: str) -> EngineView:
        raise NotImplementedError

    def _pick_for(self, request: RequestView, candidates: list[EngineView], phase: str, now_s: float) -> EngineView:
        """The engine of ``phase`` for ``request``: ``_pick`` unless a policy looks at the request too."""
        return self._pick(candidates, phase)

    def place(
        self, request: RequestView, engines: Sequence[EngineView], now_s: float, exclude: frozenset[str] = frozenset()
    ) -> Placement | Rejection:
        prefills, decodes, colocated, full = open_engines(engines, exclude, self.params)
        paired = len(prefills) + len(decodes) if prefills and decodes else 0
        if colocated and self.share.take(len(colocated), paired):
            return Placement(prefill_id=None, decode_id=self._pick_for(request, colocated, "null", now_s).instance_id)
        if prefills and decodes:
            return Placement(prefill_id=self._pick_for(request, prefills, "prefill", now_s).instance_id,
                             decode_id=self._pick_for(request, decodes, "decode", now_s).instance_id)
        return rejection(engines, full)


class LeastLoad(_PairPolicy):
    """Least-loaded prefill by pending prompt tokens; least-loaded decode by KV tokens and requests.

    Prefill cost grows with the tokens ahead in the queue, so prefill engines are ranked by in-flight
    prompt tokens. A decode step's time grows with the batch's context tokens (ARES Fig. 8), so decode
    engines are ranked by reported KV use plus what this gateway has in flight, then by request count.
    Ties go to the lowest instance id, so the choice is deterministic.
    """

    name = "least-load"

    def _pick(self, candidates: list[EngineView], phase: str) -> EngineView:
        if phase == "prefill":
            return min(candidates, key=lambda e: (e.inflight_tokens, _pending(e, self.params), e.instance_id))
        return min(
            candidates,
            key=lambda e: (
                (max(e.used_tokens, 0) + e.inflight_tokens) / max(e.kv_capacity_tokens, 1),
                e.running_reqs + e.inflight_reqs,
                e.instance_id,
            ),
        )


class RoundRobin(_PairPolicy):
    """Cycle through engines of each role (sglang-router's ``round_robin``); an ablation baseline."""

    name = "round-robin"

    def __init__(self, params: DispatchParams | None = None) -> None:
        super().__init__(params)
        self._next: dict[str, int] = {}

    def _pick(self, candidates: list[EngineView], phase: str) -> EngineView:
        ordered = sorted(candidates, key=lambda e: e.instance_id)
        i = self._next.get(phase, 0)
        self._next[phase] = i + 1
        return ordered[i % len(ordered)]
