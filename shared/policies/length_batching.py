"""DOPD's length-aware P-instance batching (spec-arrow-dopd.md B4.1-B4.3) as a prefill policy.

DOPD runs a long prompt (longer than the forecast mean input length) alone and at once, and holds short
prompts back so that several prefill in one pass (kernel efficiency): a short batch is released when its
prompts add up to L_cap tokens, or when the oldest has waited tau_max (Eq. 17), and is packed as a 0-1
knapsack up to L_cap (Eq. 18, greedy). The paper's listing is lost; this follows the spec's reconstruction
(B4.3 [R]) and its recommended defaults, which are ours, not the paper's. Ultra-short prompts that DOPD
prefills on a decode instance (B11 #9) are the dispatcher's business, not this policy's.

Pure: no I/O.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from shared.latency import LatencyModel
from shared.policies.prefill_order import PrefillItem, PrefillPlan, T, fill, remaining


@dataclass(frozen=True, slots=True)
class LengthBatchingParams:
    """Knobs of the length-aware batching. Every default is the spec's recommendation (B4.1, B4.3, B11 #4)
    or ours; the paper's values are lost."""

    kappa: float = 0.5  # Eq. 17 safety factor on the TTFT budget left for batching
    tau_min_s: float = 0.0  # lower clamp of tau_max (0: a prompt with no TTFT budget left is not held)
    tau_cap_s: float = 0.2  # upper clamp of tau_max; also tau_max for prompts without a TTFT target
    # Weight of one prompt's input length in the running mean input length (ISL_hat) that sets L_th and
    # L_cap until the planner provides DOPD's ARIMA forecast: about the last 20 prompts.
    isl_alpha: float = 0.05
    long_factor: float = 1.0  # L_th = this x ISL_hat (the paper: the forecast itself)
    cap_factor: float = 1.0  # L_cap = this x ISL_hat (spec B4.3 [REC]: batch shorts up to one mean prompt)


class LengthBatching:
    """Length-aware prefill batching (``dopd-length``).

    ``plan`` each pass:

    1. Prompts of the batch (or long prompt) released earlier that still have tokens left, and any partly
       prefilled prompt, continue first (a chunked engine, or one that ran out of KV, split the pass).
    2. A long prompt (input > L_th) runs alone. Shorts do not starve behind a stream of longs: once a short
       batch is due, it and the oldest long go in arrival order of their oldest prompt.
    3. Shorts are held until due: their remaining tokens add up to L_cap, or one has waited its tau_max,
       ``clamp(kappa * (SLO_TTFT - waited before this engine saw it - E[S]), tau_min, tau_cap)`` with E[S]
       the modelled prefill time of an L_cap-token pass (Eq. 17 without the Kingman queueing term: the
       engine sees its own queue, and the wait before it is measured). The due batch is packed up to L_cap
       tokens: prompts whose tau_max expired first (oldest first: no prompt waits for ever behind a stream
       of shorter ones, the spec's aging term), then shortest first (benefit 1 per prompt, the greedy
       knapsack of Eq. 18). The first prompt always goes, so a pass always makes progress.
    4. Otherwise the plan is empty with ``retry_at_s`` = the earliest tau_max expiry.

    L_th and L_cap come from ISL_hat: a running mean of the input lengths of the prompts this policy has
    seen, or, once the planner calls :meth:`set_forecast_isl`, DOPD's ARIMA one-step forecast of the mean
    input length (the paper's L_th). ``plan`` respects ``budget`` through ``fill``.
    """

    name = "dopd-length"
    event_driven = False  # the timeouts need asking before every pass (and at retry_at_s)

    def __init__(self, model: LatencyModel, params: LengthBatchingParams | None = None) -> None:
        self.model = model
        self.params = params or LengthBatchingParams()
        self.isl_mean: float | None = None  # running mean of the input lengths seen
        self.forecast_isl: float | None = None  # the planner's forecast; overrides the running mean
        self._seen: dict[str, float] = {}  # rid -> when this policy first saw it (its enqueue time here)
        self._released: list[str] = []  # rids of the last released pass, in its order

    # -- the thresholds -------------------------------------------------------------------------------
    def set_forecast_isl(self, tokens: float | None) -> None:
        """Use DOPD's forecast mean input length for L_th and L_cap (None: back to the running mean)."""
        self.forecast_isl = tokens if tokens is None or tokens > 0 else None

    @property
    def isl_hat(self) -> float:
        if self.forecast_isl is not None:
            return self.forecast_isl
        return self.isl_mean if self.isl_mean is not None else float(self.model.profile.chunked_prefill_size)

    @property
    def long_threshold(self) -> float:
        return self.params.long_factor * self.isl_hat

    @property
    def cap_tokens(self) -> int:
        return max(1, int(self.params.cap_factor * self.isl_hat))

    def release_at(self, item: PrefillItem) -> float:
        """When a held short prompt is due (its enqueue time here + tau_max)."""
        enq = self._seen.get(item.rid, item.arrival_s)
        p = self.params
        if math.isinf(item.slo_ttft_s):
            return enq + p.tau_cap_s
        service = self.model.prefill_time_s(self.cap_tokens)
        tau = p.kappa * (item.slo_ttft_s - (enq - item.arrival_s) - service)
        return enq + min(max(tau, p.tau_min_s), p.tau_cap_s)

    # -- plan -----------------------------------------------------------------------------------------
    def _track(self, queue: Sequence[PrefillItem], now_s: float) -> None:
        present = {r.rid for r in queue}
        for r in queue:
            if r.rid not in self._seen:
                self._seen[r.rid] = now_s
                a = self.params.isl_alpha
                self.isl_mean = float(r.input_tokens) if self.isl_mean is None else (
                    (1 - a) * self.isl_mean + a * r.input_tokens)
        # Forget prompts that left the queue (done, or moved away), so the maps stay the queue's size.
        for rid in [rid for rid in self._seen if rid not in present]:
            del self._seen[rid]
        self._released = [rid for rid in self._released if rid in present]

    def plan(self, queue: Sequence[T], budget: int, now_s: float) -> PrefillPlan[T]:
        pending = [r for r in queue if remaining(r) > 0]
        self._track(pending, now_s)
        if not pending:
            return PrefillPlan()
        # The last released pass in its own order, then any other partly done prompt (one another policy or a
        # cut pass left behind).
        by_rid = {r.rid: r for r in pending}
        current = [by_rid[rid] for rid in self._released]
        current += [r for r in pending if r.prefilled > 0 and r.rid not in self._released]
        if current:
            return PrefillPlan(fill(current, budget))
        longs = [r for r in pending if r.input_tokens > self.long_threshold]
        shorts = [r for r in pending if r.input_tokens <= self.long_threshold]
        due = min((self.release_at(r) for r in shorts), default=math.inf)
        ready = bool(shorts) and (sum(remaining(r) for r in shorts) >= self.cap_tokens or due <= now_s)
        if longs and not (ready and pending.index(shorts[0]) < pending.index(longs[0])):
            chosen = [longs[0]]
        elif ready:
            chosen = self.pack(shorts, now_s)
        else:
            return PrefillPlan(retry_at_s=due)
        self._released = [r.rid for r in chosen]
        return PrefillPlan(fill(chosen, budget))

    def pack(self, shorts: Sequence[T], now_s: float) -> list[T]:
        """Greedy knapsack up to L_cap: expired prompts (oldest first), then shortest first; never empty."""
        cap = self.cap_tokens
        expired = [r for r in shorts if self.release_at(r) <= now_s]
        rest = sorted((r for r in shorts if self.release_at(r) > now_s), key=remaining)  # stable: arrival on ties
        chosen: list[T] = []
        used = 0
        for r in [*expired, *rest]:
            n = remaining(r)
            if not chosen or used + n <= cap:
                chosen.append(r)
                used += n
        return chosen

    def observe(self, tokens: int, seconds: float) -> None:
        return None
