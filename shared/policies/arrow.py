"""Arrow (arXiv 2505.11916): SLO-aware dispatch (Algorithms 1-2) and instance flips (Algorithms 3-4).

Two pure objects, one per decision (../shared/spec/spec-arrow-dopd.md, part A):

- :class:`ArrowDispatch` places each request. Prefill (Alg. 1): the prefill instance with the least
  predicted queue delay (per-instance quadratic TTFT predictor over the prompts it has in flight); decode
  (Alg. 2): among decode instances whose running tokens stay under Max Running Tokens with this request and
  whose recent token interval meets the TPOT SLO, the one with the fewest running tokens; else the fewest.
- :class:`ArrowPools` flips instances (the planner's loop): P→D when the decode instances' token interval
  has been over the TPOT SLO for a while, when no decode instance can take more tokens, or when a prefill
  instance idles while decode is busy; D→P when every prefill instance would miss the TTFT SLO for an
  average prompt *and* decode load is low. Decode wins when both want an instance (Arrow's overload rule).

Where SGLang differs from Arrow's engine (written down, as the issue asks):

- Arrow's instances run both phases at once, so a flip is free and immediate. SGLang serves one role at a
  time: a flip stops new work of the old role, drains, calls ``/pd_role_switch`` and re-registers. Arrow's
  transitional pools P→D / D→P are therefore *draining* instances that take no new work of either kind.
- Arrow binds the decode instance after the prefill (late binding) and keeps a request on its prefill
  instance when that one has meanwhile become a decode instance. SGLang's router binds both at dispatch
  (the decode side pre-allocates KV and claims the bootstrap room), so Alg. 2 runs at dispatch time with
  the same rule, and the "stay on the prefill instance" branch never applies.
- Arrow triggers D→P inside Alg. 1 for the request being placed. Since a flip drains first, it cannot help
  that request; the trigger moves to the planner's loop (every ``interval_s``), on the same condition.

Predicates the paper leaves open use the spec's recommendations (A10), as :class:`ArrowParams` fields.
"""

from __future__ import annotations

from collections.abc import Sequence

import msgspec

from shared.latency import LatencyModel
from shared.policies.cache_aware import RoutedPrefixes
from shared.policies.context import PolicyContext
from shared.policies.dispatch import (
    ColocatedShare,
    DispatchParams,
    Placement,
    Rejection,
    open_engines,
    rejection,
)
from shared.policies.pools import PoolDecision, RoleChange
from shared.policies.report import ArrowState, PolicyReport
from shared.policies.ttft_predictor import QuadraticTtft
from shared.policies.views import EngineView, RequestView
from shared.protocol.messages import ClusterSnapshot, InstanceLoad


class ArrowParams(msgspec.Struct, frozen=True, kw_only=True):
    max_tokens_margin: float = 0.9  # Max Running Tokens: batch tokens whose step stays under SLO x this (A10.6)
    d2p_max_token_frac: float = 0.6  # "decode load is low": mean running tokens per remaining D <= this x MAX
    d2p_max_tpot_frac: float = 0.8  # ...and mean token interval <= this x TPOT SLO (A10.1)
    tpot_breach_s: float = 2.0  # token interval over the SLO this long triggers P→D (A10.2)
    idle_s: float = 1.0  # a prefill instance with nothing to do this long is idle (A10.3)
    busy_frac: float = 0.8  # decode is busy when an instance is over this x MAX tokens or x TPOT SLO
    flip_cooldown_s: float = 2.0  # at least this long between flips (the paper has no hysteresis)
    min_dwell_s: float = 30.0  # an instance stays in its new role at least this long (ours: a flip drains)
    interval_s: float = 0.5  # how often the planner evaluates the flip triggers
    # D→P when the best predicted TTFT exceeds this x TTFT SLO. Arrow's rule is 1.0 (flip once the SLO would
    # be missed), which assumes a free flip; a SGLang flip drains first, so we flip at half (measured in the
    # simulator on Azure code: see tests/bench/results/adaptive_pd.md).
    d2p_ttft_frac: float = 0.5
    # D→P also needs the monitor's latest observed TTFT P90 over this x TTFT SLO (ours; None: off, as in Arrow
    # alone). The predicted TTFT is a FCFS queue model: engines that prefill by deadline (FlowPrefill) meet
    # targets it says they miss, and a flip made on that drains a decode instance for nothing.
    d2p_observed_frac: float | None = None
    # While requests wait on a decode instance, "decode load is low" also needs the KV in use on the decode
    # instances, spread over one instance fewer, at most this share of their capacity (ours). Arrow's check
    # counts the running batch's tokens only, and under long prompts decode runs out of KV before it reaches
    # Max Running Tokens: on Mooncake at 2x the trace's rate under Kairos' SLOs, Poise's Arrow took a decode
    # instance while every one was over 88% KV with dozens of requests waiting for memory, and attainment
    # fell from 95% to 49%. Without the waiting condition, the check also held back flips where short outputs
    # turn the KV over fast (Poise on Azure code: goodput 18.5x to 17.5x).
    d2p_max_kv_frac: float = 0.6


def max_running_tokens(model: LatencyModel, tpot_slo_s: float, margin: float) -> int:
    """Arrow's Max Running Tokens: min(KV capacity, most batch tokens one decode step serves within the SLO).

    The step's per-sequence term is charged for a full batch (``max_running_requests``): conservative.
    """
    p = model.profile
    per_token = p.decode_s_per_context_token * model.time_scale
    budget = margin * tpot_slo_s - (p.decode_overhead_s + p.decode_s_per_seq * p.max_running_requests) * model.time_scale
    by_time = int(budget / per_token) if per_token > 0 and budget > 0 else p.kv_capacity_tokens
    return max(1, min(p.kv_capacity_tokens, by_time))


class _ArrowModel:
    """What both Arrow objects share: the SLO, Max Running Tokens, and a TTFT predictor per instance."""

    def __init__(self, model: LatencyModel, ctx: PolicyContext, params: ArrowParams | None) -> None:
        self.model, self.ctx = model, ctx
        self.params = params or ArrowParams()
        self.max_tokens = max_running_tokens(model, ctx.tpot_slo_s, self.params.max_tokens_margin)
        self._profile_fit = QuadraticTtft.from_model(model)
        self.predictors: dict[str, QuadraticTtft] = {}

    def predictor(self, instance_id: str) -> QuadraticTtft:
        pred = self.predictors.get(instance_id)
        if pred is None:
            f = self._profile_fit
            pred = self.predictors[instance_id] = QuadraticTtft(f.a, f.b, f.c)
        return pred

    def observe_prefill(self, instance_id: str, prompt_tokens: int, seconds: float) -> None:
        """A prompt prefilled alone on ``instance_id`` took ``seconds``: refit that instance's predictor."""
        self.predictor(instance_id).observe(prompt_tokens, seconds)


class ArrowDispatch(_ArrowModel):
    """Algorithms 1 and 2, bound at dispatch time (SGLang picks both engines up front)."""

    name = "arrow"

    def __init__(self, model: LatencyModel, ctx: PolicyContext, params: ArrowParams | None = None,
                 dispatch: DispatchParams | None = None) -> None:
        super().__init__(model, ctx, params)
        self.dispatch_params = dispatch or DispatchParams()
        self.share = ColocatedShare()
        self.prefixes = RoutedPrefixes()

    def prefill_delay(self, e: EngineView) -> float:
        return self.predictor(e.instance_id).queue_delay(e.inflight_reqs, e.inflight_tokens, e.inflight_tokens_sq)

    def running_tokens(self, e: EngineView) -> int:
        return max(e.used_tokens, 0) + e.inflight_tokens

    def place(self, request: RequestView, engines: Sequence[EngineView], now_s: float,
              exclude: frozenset[str] = frozenset()) -> Placement | Rejection:
        prefills, decodes, colocated, full = open_engines(engines, exclude, self.dispatch_params)
        paired = len(prefills) + len(decodes) if prefills and decodes else 0
        if colocated and self.share.take(len(colocated), paired):
            chosen = self._decode(request, colocated, by_prefix=True)
            self.prefixes.record(chosen, request, now_s)
            return Placement(prefill_id=None, decode_id=chosen.instance_id)
        if prefills and decodes:
            prefill = self._prefill(request, prefills)
            self.prefixes.record(prefill, request, now_s)
            return Placement(prefill_id=prefill.instance_id, decode_id=self._decode(request, decodes).instance_id)
        return rejection(engines, full)

    def _prefill(self, request: RequestView, prefills: list[EngineView]) -> EngineView:
        # Alg. 1: least predicted queue delay. Whether it meets the SLO matters for flips, which the
        # planner decides (see the module docstring); the request goes to the best instance either way.
        if not self._cached_somewhere(request, prefills):
            return min(prefills, key=lambda e: (self.prefill_delay(e), e.instance_id))
        return min(prefills, key=lambda e: (self._ttft(request, e), e.instance_id))

    def _cached_somewhere(self, request: RequestView, engines: list[EngineView]) -> bool:
        """Whether any of ``engines`` likely caches a prefix of the prompt: only then is there a saving to
        weigh, and the rules stay Arrow's where no prompt shares a prefix."""
        return bool(request.prefix_blocks) and any(self.prefixes.cached_tokens(e, request) for e in engines)

    def _ttft(self, request: RequestView, e: EngineView) -> float:
        """With a prefix an engine may cache, the predicted TTFT adds this prompt's own prefill there: only its
        uncached part (shared/policies/cache_aware.py), after the cached prefix."""
        cached = self.prefixes.cached_tokens(e, request)
        return self.prefill_delay(e) + self.model.prefill_time_s(request.input_tokens - cached, cached)

    def _decode(self, request: RequestView, decodes: list[EngineView], by_prefix: bool = False) -> EngineView:
        tpot_slo = request.slo_tpot_s or self.ctx.tpot_slo_s
        need = request.input_tokens + request.max_output_tokens  # A5.3 [REC]: count the request itself

        # (running tokens, id, engine): each engine's load read once, for the fit and for the ranking.
        loads = [(self.running_tokens(e), e.instance_id, e) for e in decodes]
        fitting = [x for x in loads if x[0] + need <= self.max_tokens
                   and (x[2].token_interval_s is None or x[2].token_interval_s <= tpot_slo)]
        candidates = fitting or loads
        if by_prefix and self._cached_somewhere(request, [e for _, _, e in candidates]):
            # A colocated engine prefills the prompt too: among those that fit, the least predicted TTFT.
            return min(candidates, key=lambda x: (self._ttft(request, x[2]), x[0], x[1]))[2]
        return min(candidates, key=_load_and_id)[2]


def _load_and_id(load: tuple[int, str, EngineView]) -> tuple[int, str]:
    return load[0], load[1]


class ArrowPools(_ArrowModel):
    """Algorithms 3 and 4 with the monitor-driven triggers; one flip at a time, decode first."""

    name = "arrow"
    note = "arrow: flips P→D on TPOT breach / full decode / idle prefill, D→P when every prefill misses TTFT"

    def __init__(self, model: LatencyModel, ctx: PolicyContext, params: ArrowParams | None = None) -> None:
        super().__init__(model, ctx, params)
        self.interval_s = self.params.interval_s
        self._breach_since: float | None = None
        self._idle_since: dict[str, float] = {}
        self.last_flip_s = float("-inf")
        self._flipped_at: dict[str, float] = {}
        self.bounds: tuple[int, int] | None = None  # (min prefill, max prefill) set by a ratio planner (DOPD)
        # When each trigger last fired, to the new role it asks for, whether or not a flip followed (bounds,
        # cooldown, a flip in flight or no instance free to move). A ratio planner that bounds Arrow reads it
        # to tell "the pressure is over" from "Arrow is held at the bound" (shared/policies/poise.py).
        self.wanted_s: dict[str, float] = {"prefill": float("-inf"), "decode": float("-inf")}

    # -- estimates from the monitor's snapshot ------------------------------------------------------
    def _prefill_delay(self, inst: InstanceLoad) -> float:
        load = inst.load
        if load is None:
            return 0.0
        n = load.compute_waiting_reqs + load.num_running_reqs  # the prompts num_waiting_uncached_tokens counts
        if n <= 0:
            return 0.0
        # The snapshot has only the queue's total tokens: assume equal prompts (exact for one prompt).
        mean = load.num_waiting_uncached_tokens / n
        return self.predictor(inst.info.instance_id).queue_delay(n, load.num_waiting_uncached_tokens, int(n * mean * mean))

    @staticmethod
    def _running_tokens(inst: InstanceLoad) -> int:
        """Arrow's decode load: tokens of the running batch (KV in use when the engine does not say)."""
        load = inst.load
        if load is None:
            return 0
        return load.num_running_tokens if load.num_running_tokens is not None else load.num_used_tokens

    @staticmethod
    def _token_interval(inst: InstanceLoad) -> float | None:
        load = inst.load
        if load is None or load.num_running_reqs <= 0 or load.gen_throughput_tps <= 0:
            return None
        return load.num_running_reqs / load.gen_throughput_tps

    def report(self) -> PolicyReport:
        return PolicyReport(arrow=ArrowState(bounds=self.bounds, max_running_tokens=self.max_tokens,
                                             last_flip_s=self.last_flip_s, wanted_s=dict(self.wanted_s)))

    def decide(self, snapshot: ClusterSnapshot, now_s: float) -> PoolDecision | None:
        ready = [i for i in snapshot.instances if i.info.status == "ready" and i.load is not None]
        prefills = [i for i in ready if i.info.role == "prefill"]
        decodes = [i for i in ready if i.info.role == "decode"]
        in_flight = any(i.info.status in ("draining", "switching") for i in snapshot.instances)
        self._track(prefills, decodes, now_s)
        # A freshly flipped instance is idle in its new role: without a dwell time the idle rule flips it back.
        settled_p = [p for p in prefills if not self._dwelling(p, now_s)]
        settled_d = [d for d in decodes if not self._dwelling(d, now_s)]
        # The triggers are read every interval (for wanted_s); the flip itself waits for the one in flight
        # and the cooldown, so the next decision sees the last flip's effect.
        to_decode = self._decode_reason(settled_p, decodes, now_s)
        to_prefill = self._prefill_reason(prefills, decodes, snapshot)
        for role, reason in (("decode", to_decode), ("prefill", to_prefill)):
            if reason is not None:
                self.wanted_s[role] = now_s
        if in_flight or now_s - self.last_flip_s < self.params.flip_cooldown_s:
            return None
        change = self._to_decode(prefills, settled_p, to_decode) if to_decode is not None else None
        if change is None and to_prefill is not None:
            change = self._to_prefill(prefills, decodes, settled_d, to_prefill)
        if change is None:
            return None
        self.note_flip(change.instance_id, now_s)
        return PoolDecision(changes=[change])

    def note_flip(self, instance_id: str, now_s: float) -> None:
        """Record a flip (also one another policy made) for the cooldown and the dwell time."""
        self.last_flip_s = now_s
        self._flipped_at[instance_id] = now_s

    def _dwelling(self, inst: InstanceLoad, now_s: float) -> bool:
        return now_s - self._flipped_at.get(inst.info.instance_id, float("-inf")) < self.params.min_dwell_s

    def _track(self, prefills: list[InstanceLoad], decodes: list[InstanceLoad], now_s: float) -> None:
        intervals = [t for t in (self._token_interval(d) for d in decodes) if t is not None]
        if intervals and sum(intervals) / len(intervals) > self.ctx.tpot_slo_s:
            self._breach_since = now_s if self._breach_since is None else self._breach_since
        else:
            self._breach_since = None
        for p in prefills:
            load = p.load
            busy = load is not None and (load.num_running_reqs + load.num_waiting_reqs + load.prefill_queue_reqs) > 0
            if busy:
                self._idle_since.pop(p.info.instance_id, None)
            else:
                self._idle_since.setdefault(p.info.instance_id, now_s)

    def _decode_reason(self, movable: list[InstanceLoad], decodes: list[InstanceLoad], now_s: float) -> str | None:
        """Alg. 4's triggers (decode has priority, so no prefill-load check): why decode needs an instance."""
        if self._breach_since is not None and now_s - self._breach_since >= self.params.tpot_breach_s:
            return f"decode token interval over the {self.ctx.tpot_slo_s * 1e3:.0f} ms TPOT SLO"
        if decodes and all(self._running_tokens(d) >= self.max_tokens for d in decodes):
            return f"every decode instance at Max Running Tokens ({self.max_tokens})"
        idle = [p for p in movable if now_s - self._idle_since.get(p.info.instance_id, now_s) >= self.params.idle_s]
        if idle and self._decode_busy(decodes):
            return "a prefill instance idles while decode is busy"
        return None

    def _to_decode(self, prefills: list[InstanceLoad], movable: list[InstanceLoad], reason: str) -> RoleChange | None:
        """Alg. 4: the prefill instance with the least queued work, within the bounds."""
        if len(prefills) <= max(1, self.bounds[0] if self.bounds else 1) or not movable:
            return None
        target = min(movable, key=lambda p: (self._prefill_delay(p), p.info.instance_id))
        return RoleChange(instance_id=target.info.instance_id, new_role="decode", reason=f"arrow: {reason}")

    def _prefill_reason(self, prefills: list[InstanceLoad], decodes: list[InstanceLoad],
                        snapshot: ClusterSnapshot) -> str | None:
        """Alg. 3's trigger (Alg. 1): every prefill instance misses the TTFT SLO. (The pressure only: whether
        decode can spare an instance is :meth:`_to_prefill`'s check.)"""
        if len(decodes) <= 1 or not prefills:
            return None
        # The mean prompt as the prefill engines see it: its cached prefix (the monitor's moments of the engines'
        # reported cached tokens) costs no prefill, as the queue's num_waiting_uncached_tokens already counts.
        point = next((p for p in reversed(snapshot.series) if p.completed), None)
        isl, cached, cached_sq = ((point.mean_input_tokens, point.mean_cached_input_tokens, point.mean_cached_input_tokens_sq)
                                  if point is not None else (1024.0, 0.0, 0.0))
        best = min(self._prefill_delay(p) + self.predictor(p.info.instance_id).predict_uncached(isl, cached, cached_sq)
                   for p in prefills)
        threshold = self.params.d2p_ttft_frac * self.ctx.ttft_slo_s
        if best <= threshold:
            return None
        if self.params.d2p_observed_frac is not None:
            observed = next((p.ttft_p90_s for p in reversed(snapshot.series) if p.ttft_p90_s is not None), None)
            if observed is None or observed <= self.params.d2p_observed_frac * self.ctx.ttft_slo_s:
                return None
        return f"best predicted TTFT {best:.2f} s over the {self.ctx.ttft_slo_s:g} s SLO"

    def _to_prefill(self, prefills: list[InstanceLoad], decodes: list[InstanceLoad], movable: list[InstanceLoad],
                    reason: str) -> RoleChange | None:
        """Alg. 3: when decode load is low, the decode instance with the fewest running tokens, within the
        bounds."""
        if not movable or (self.bounds is not None and len(prefills) >= self.bounds[1]) or not self._decode_low(decodes):
            return None
        target = min(movable, key=lambda d: (self._running_tokens(d), d.info.instance_id))
        return RoleChange(instance_id=target.info.instance_id, new_role="prefill", reason=f"arrow: {reason}")

    def _decode_low(self, decodes: list[InstanceLoad]) -> bool:
        tokens = sum(self._running_tokens(d) for d in decodes)
        if tokens / (len(decodes) - 1) > self.params.d2p_max_token_frac * self.max_tokens:
            return False
        loads = [d.load for d in decodes if d.load is not None and d.load.max_total_num_tokens > 0]
        if loads:  # engines that report no capacity are judged by their batch tokens alone
            used = sum(x.num_used_tokens for x in loads) / (len(loads) - 1 or 1)
            waiting = any(x.num_waiting_reqs > 0 for x in loads)
            if waiting and used > self.params.d2p_max_kv_frac * sum(x.max_total_num_tokens for x in loads) / len(loads):
                return False
        intervals = [t for t in (self._token_interval(d) for d in decodes) if t is not None]
        return not intervals or sum(intervals) / len(intervals) <= self.params.d2p_max_tpot_frac * self.ctx.tpot_slo_s

    def _decode_busy(self, decodes: list[InstanceLoad]) -> bool:
        frac = self.params.busy_frac
        for d in decodes:
            interval = self._token_interval(d)
            used = self._running_tokens(d)
            if used > frac * self.max_tokens or (interval is not None and interval > frac * self.ctx.tpot_slo_s):
                return True
        return False
