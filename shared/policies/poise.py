"""Poise's default pool policy: DOPD's forecast sets the split, Arrow's flips react within it.

How the two are arbitrated. DOPD works on the minute scale: every ``interval_s`` it forecasts ISL and OSL,
computes the optimal ratio (Eq. 14) and turns it into a target number of prefill instances. Arrow works on
the second scale: its triggers (TPOT breach, full or busy decode, TTFT pressure) flip single instances. The
target bounds Arrow: Arrow may move the prefill count at most ``slack`` instances away from DOPD's target,
and when the count is outside that band (the forecast moved, or at start) DOPD's own flip comes first.
Arrow may not take a prefill instance below the target while the observed TTFT is already at risk. When
Arrow's trigger for the side it moved the count to has been quiet for ``settle_s`` (not merely no flip: at
the band's edge Arrow flips no more while the pressure lasts) and the forecast gave the same target
``confirm`` intervals in a row, the count drifts back to the target one flip at a time. So a burst gets
Arrow's quick reaction, and the split returns to the forecast's optimum afterwards, but not to a target seen
once: a flip drains an instance for as long as its longest request, and the first forecasts (one interval of
data) swing.
"""

from __future__ import annotations

import math

import msgspec

from shared.latency import LatencyModel
from shared.policies.arrow import ArrowParams, ArrowPools
from shared.policies.context import PolicyContext
from shared.policies.dopd import DopdParams, DopdPools, flip_towards
from shared.policies.pools import PoolDecision
from shared.protocol.messages import ClusterSnapshot


def _arrow_inside_poise() -> ArrowParams:
    # With DOPD provisioning ahead of the load, Arrow only answers breaches: D→P once the TTFT SLO would be
    # missed (Arrow's own threshold, not the earlier one Arrow alone needs), and no idle-prefill rule (the
    # forecast ratio covers that case). With the idle rule and the early threshold, Poise lost 8% goodput on
    # Mooncake to drains; without them it matched static-best (python -m tests.bench.sim_goodput).
    # Poise's engines prefill by deadline (FlowPrefill), which Arrow's FCFS TTFT prediction does not model:
    # a D→P flip also needs the observed TTFT P90 past half the SLO. Without that check Poise flipped a decode
    # instance on a predicted breach the engines never had and lost to FlowPrefill on a static 4P4D on Azure
    # conversation's mixed-SLO benchmark (23.5x vs 24.0x); with it, 24.0x, and Azure code's rose from 15.5x
    # to 17.0x, with the single-SLO goodput unchanged on all three traces (tests/bench/prefill_scheduling.py,
    # sim_goodput.py).
    return ArrowParams(d2p_ttft_frac=1.0, idle_s=math.inf, d2p_observed_frac=0.5)


class PoiseParams(msgspec.Struct, frozen=True, kw_only=True):
    slack: int = 1  # Arrow may flip this many instances away from DOPD's target
    settle_s: float = 30.0  # after this long with Arrow's pressure over (and no flip), drift back to DOPD's target
    # Drift only to a target the forecast gave this many intervals in a row (spec-arrow-dopd.md erratum 7's
    # "two consecutive intervals"). Without it, Poise drained a decode instance for 22 s on Azure
    # conversation's first forecast and flipped it back 30 s later (tests/bench/prefill_scheduling.py).
    confirm: int = 2
    arrow: ArrowParams = msgspec.field(default_factory=_arrow_inside_poise)
    dopd: DopdParams = msgspec.field(default_factory=DopdParams)


class PoisePools:
    name = "poise"
    note = "poise: DOPD's forecast sets the P:D target, Arrow flips within ±1 of it"

    def __init__(self, model: LatencyModel, ctx: PolicyContext, params: PoiseParams | None = None) -> None:
        self.params = params or PoiseParams()
        self.dopd = DopdPools(model, ctx, self.params.dopd)
        self.arrow = ArrowPools(model, ctx, self.params.arrow)
        self.interval_s = self.arrow.interval_s
        self._next_forecast = float("-inf")
        self._streak = 0  # consecutive forecasts that gave the current target

    def decide(self, snapshot: ClusterSnapshot, now_s: float) -> PoolDecision | None:
        if now_s >= self._next_forecast:
            self._next_forecast = now_s + self.dopd.interval_s
            before = self.dopd.target_prefill
            self.dopd.update_target(snapshot)
            self._streak = self._streak + 1 if self.dopd.target_prefill == before else 1
        target = self.dopd.target_prefill
        if target is None:
            return self.arrow.decide(snapshot, now_s)  # no forecast yet: Arrow alone
        slack = self.params.slack
        # Below the target only while TTFT is not already at risk: with decode full too, both sides are short.
        # Arrow gives decode priority, but a prefill instance taken below the forecast's split only moves the
        # shortage; the ratio, which prices both sides, arbitrates (Mooncake at 2x under a 25 ms TPOT: 61.0%
        # to 65.5% E2E attainment).
        self.arrow.bounds = (target if self._ttft_at_risk(snapshot) else target - slack, target + slack)
        prefills = sum(1 for i in snapshot.instances if i.info.role == "prefill" and i.info.status == "ready")
        if not target - slack <= prefills <= target + slack:
            changes = flip_towards(snapshot, target, "poise (dopd target)")
            for change in changes:
                self.arrow.note_flip(change.instance_id, now_s)
            return PoolDecision(changes=changes)
        decision = self.arrow.decide(snapshot, now_s)
        if decision is not None and decision.changes:
            return decision
        if prefills != target and self._settled(prefills > target, now_s) and self._streak >= self.params.confirm:
            # The burst Arrow reacted to is over: back to the forecast's optimum.
            changes = flip_towards(snapshot, target, "poise (back to the dopd target)")
            for change in changes:
                self.arrow.note_flip(change.instance_id, now_s)
            return PoolDecision(changes=changes)
        return None

    def _settled(self, above: bool, now_s: float) -> bool:
        """No flip for ``settle_s``, and Arrow's trigger for the side it moved the count to quiet as long: an
        Arrow held at the band's edge flips no more, but its pressure is not over (the side it moved to is
        prefill when the count is above the target)."""
        quiet_since = max(self.arrow.last_flip_s, self.arrow.wanted_s["prefill" if above else "decode"])
        return now_s - quiet_since >= self.params.settle_s

    def _ttft_at_risk(self, snapshot: ClusterSnapshot) -> bool:
        """The monitor's latest TTFT P90 past the share of the SLO that Arrow's D→P check also requires."""
        frac = self.params.arrow.d2p_observed_frac
        observed = next((p.ttft_p90_s for p in reversed(snapshot.series) if p.ttft_p90_s is not None), None)
        return frac is not None and observed is not None and observed > frac * self.arrow.ctx.ttft_slo_s
