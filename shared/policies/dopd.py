"""DOPD (arXiv 2511.20982): forecast the load, compute the optimal P:D ratio, resize (or flip) to it.

Part B of ../shared/spec/spec-arrow-dopd.md; DOPD's equations and algorithms are missing from our copy of
the paper, so this follows the spec's reconstruction (tags there), with our choices marked "ours".

Every ``interval_s`` the policy reads the monitor's series for the last interval (mean ISL, OSL, request
rate and concurrency), feeds them to ARIMA forecasters (``shared.forecast``: order by AIC over a small grid,
DOPD's predicted/observed correction factor, last-value fallback), and computes from the engines' latency
profile (:func:`optimal_split`):

- Eq. 11-13: the most requests one decode instance holds, N_max = min(KV capacity, KV tokens one step can
  read within the TPOT SLO) / (ISL + OSL), capped by ``max_running_requests``; N_d = γ·N_max (γ = 0.9);
- Eq. 14: R* = N_d·T_p / (OSL·T_d), with T_p the prefill time of one ISL prompt and T_d the decode step
  at N_d requests of context ISL + OSL/2;
- counts: N_D = ceil(C / N_d) for forecast concurrency C, and N_P = max(ceil(R*·N_D), ceil(λ·T_p / ρ)).
  The first term is the spec's; it assumes the decode instances run at N_d, where a step takes T_d. Below
  that the steps are shorter, the same concurrency carries a higher request rate λ, and R*·N_D leaves
  prefill short: the second term (ours) provisions prefill for the forecast rate by Little's law, with a
  utilisation target ρ = 0.8 that keeps the prefill queue out of the Kingman knee.
- local prefill (ours): Eq. 14 prices every prompt on the prefill instances, but DOPD's PD aggregation
  prefills ultra-short prompts on their decode instance (``shared.policies.local_prefill``). With a share f of
  the completed requests prefilled there (the monitor's series says which: no prefill instance), mean length
  L, a prefill instance spends (1 - f)·T_p(ISL_remote) per request, ISL_remote = (ISL - f·L) / (1 - f), and
  a decode instance spends OSL·T_d / N_d plus f·W(L), W the prefill work a mixed step adds. R* is the ratio
  of the two, N_d·(1 - f)·T_p / (OSL·T_d + N_d·f·W), and the rate term uses the same prefill time; with
  f = 0 both are the spec's. Without this, Poise's target on Azure conversation was 5P3D, where 29% of the
  prompts stay local and a static 4P4D holds 9-24% more goodput than 5P3D with FlowPrefill engines, and with
  FCFS engines under Arrow's SLO (not under FlowPrefill's tight mixed SLOs, where FCFS needs the headroom:
  docs/engine-scheduling.md, "The composed default").

Two ways to act on it: :class:`DopdScaling` (a scaling policy: replica counts, with DOPD's burst fast path
on prefill queue depth and KV use and a per-step change limit), and :class:`DopdPools` (a pool policy for a
fixed GPU count: the split R*/(1+R*) of the instances, reached by flips one at a time).

The ARIMA fits are the slow part (tens of ms). The live planner calls ``decide`` from a thread executor;
the simulator calls it inline.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence

import msgspec

from shared.forecast import ForecastParams, MultiForecaster
from shared.latency import LatencyModel
from shared.policies.context import PolicyContext
from shared.policies.pools import PoolDecision, RoleChange
from shared.policies.report import PolicyReport, split_line
from shared.policies.scaling import ScalingTarget, active, fit_budget
from shared.protocol.messages import ClusterSnapshot, InstanceLoad, SeriesPoint
from shared.series import merge_points


class DopdParams(msgspec.Struct, frozen=True, kw_only=True):
    interval_s: float = 10.0  # DOPD's 70B config adjusts every 10 s (Dynamo's default is 180 s)
    gamma: float = 0.9  # decode concurrency de-rating for bursts (the paper's value is lost; spec REC)
    prefill_utilisation: float = 0.8  # ours: keep prefill queues out of the Kingman knee
    max_step: int = 2  # most instances added or removed per role per decision (spec REC)
    queue_per_prefill: float = 5.0  # burst fast path: queued prompts per prefill instance (Dynamo's load planner)
    kv_high: float = 0.9  # burst fast path: mean decode KV use (Dynamo's load planner)
    scale_in_after: int = 6  # a lower count must come out this many intervals in a row (ours; spec REC is 2)
    dead_band: float = 0.25  # fixed GPU count: move the split only when the share is 0.75 instances off (ours)
    # DOPD's correction factor f = forecast / observed, averaged over recent intervals (EWMA 0.2, ours): taken
    # from one interval alone, as the paper describes it, it made the forecasts worse on both Azure traces
    # (tests/bench/results/forecast_latency.md); averaged, it is roughly neutral.
    forecast: ForecastParams = msgspec.field(default_factory=lambda: ForecastParams(correction_smoothing=0.2))


class Split(msgspec.Struct, frozen=True, kw_only=True):
    """One evaluation of DOPD's model: what it computed and from what (for logs and tests)."""

    isl: float
    osl: float
    concurrency: float
    rate_rps: float
    n_max: int
    n_d: int
    t_prefill_s: float  # one prompt of the length the prefill instances get (ISL_remote)
    t_decode_s: float
    ratio: float  # R* = N_P / N_D at full decode instances
    prefill: int
    decode: int
    local_share: float = 0.0  # f: the share of requests prefilled on their decode instance
    t_local_s: float = 0.0  # W(L): what one such prompt adds to its decode instance's steps


def optimal_split(model: LatencyModel, ctx: PolicyContext, isl: float, osl: float, concurrency: float,
                  rate_rps: float = 0.0, params: DopdParams | None = None, *, local_share: float = 0.0,
                  local_isl: float = 0.0, cached: float = 0.0) -> Split:
    """Eq. 11-14 on the latency profile: the counts for ``concurrency`` requests in flight arriving at
    ``rate_rps`` (no budget applied), when a share ``local_share`` of the requests, of mean prompt length
    ``local_isl``, is prefilled on the decode instances (DOPD's local prefill; the module docstring), and
    prefill instances find ``cached`` prompt tokens per request in their prefix cache (averaged over every
    request): a prefill instance computes only the rest of a prompt, after its cached prefix."""
    params = params or DopdParams()
    p = model.profile
    isl, osl = max(1.0, isl), max(1.0, osl)
    per_token = p.decode_s_per_context_token * model.time_scale
    readable = (ctx.tpot_slo_s - p.decode_overhead_s * model.time_scale) / per_token if per_token > 0 else math.inf
    n_max = int(min(p.kv_capacity_tokens, max(readable, 0.0)) // (isl + osl))
    n_max = max(1, min(n_max, p.max_running_requests))
    n_d = max(1, int(params.gamma * n_max))
    f = min(1.0, max(0.0, local_share))
    local_isl = min(isl, max(0.0, local_isl)) if f > 0 else 0.0
    remote_isl = max(1.0, (isl - f * local_isl) / (1.0 - f)) if f < 1 else isl
    hit = min(remote_isl - 1.0, max(0.0, cached) / (1.0 - f)) if f < 1 else 0.0  # per remote prompt
    t_p = model.prefill_time_s(int(remote_isl - hit), int(hit))
    t_local = model.prefill_work_s(int(local_isl)) if f > 0 else 0.0
    t_d = model.decode_step_time_s(n_d, int(n_d * (isl + osl / 2)))
    decode_work = osl * t_d + n_d * f * t_local  # decode-instance seconds per N_d requests
    ratio = n_d * (1.0 - f) * t_p / decode_work if decode_work > 0 else math.inf
    concurrency = max(0.0, concurrency)
    decode = max(ctx.min_per_role, math.ceil(concurrency / n_d))
    by_rate = math.ceil(max(0.0, rate_rps) * (1.0 - f) * t_p / params.prefill_utilisation)
    prefill = max(ctx.min_per_role, math.ceil(ratio * decode) if math.isfinite(ratio) else 1, by_rate)
    return Split(isl=isl, osl=osl, concurrency=concurrency, rate_rps=rate_rps, n_max=n_max, n_d=n_d, t_prefill_s=t_p, t_decode_s=t_d,
                 ratio=ratio, prefill=prefill, decode=decode, local_share=f, t_local_s=t_local)


def split_of(total: int, ratio: float, min_per_role: int = 1, current: int | None = None,
             dead_band: float = 0.0) -> tuple[int, int]:
    """A fixed number of instances divided as R*:1 (prefill:decode), at least ``min_per_role`` each.

    With ``current``, the prefill count stays put unless the exact share is more than ``0.5 + dead_band``
    instances away from it: a ratio hovering near a rounding boundary must not flip an instance back and
    forth (each flip drains an instance).
    """
    exact = total * ratio / (1.0 + ratio) if math.isfinite(ratio) else float(total)
    prefill = current if current is not None and abs(exact - current) <= 0.5 + dead_band else round(exact)
    prefill = max(min_per_role, min(total - min_per_role, prefill))
    return prefill, total - prefill


#: Decision times a report carries (the newest; the count covers them all).
FORECAST_TIMES_KEPT = 500


class _Forecasting:
    """The part both DOPD policies share: series in, calibrated forecasts out, on each interval."""

    def __init__(self, model: LatencyModel, ctx: PolicyContext, params: DopdParams | None) -> None:
        self.model, self.ctx = model, ctx
        self.params = params or DopdParams()
        self.interval_s = self.params.interval_s
        self.forecaster = MultiForecaster(("isl", "osl", "concurrency", "rate"), self.params.forecast)
        self._seen_until = -math.inf  # series points up to this start time were observed
        # The newest interval's share of completed requests prefilled on their decode instance, and their mean
        # prompt length (observed, not forecast: it follows the dispatch rule, which the lengths drive).
        self.local_share = 0.0
        self.local_isl = 0.0
        self.cached = 0.0  # prompt tokens per request prefill instances found cached (observed, like local_share)
        self.last_split: Split | None = None
        self.decision_s: list[float] = []  # wall seconds per decision (forecast + ratio), for the benchmark

    def _observe(self, series: Sequence[SeriesPoint]) -> bool:
        """Feed the points of the newest interval_s of series to the forecasters; False when there are none."""
        fresh = [p for p in series if p.start_unix_s > self._seen_until]
        if not fresh:
            return False
        self._seen_until = fresh[-1].start_unix_s
        merged = merge_points(fresh[-max(1, int(round(self.interval_s / max(fresh[-1].interval_s, 1e-9)))):])
        assert merged is not None
        values = {"concurrency": merged.mean_running_reqs, "rate": merged.arrival_rate_rps}
        if merged.completed:
            values["isl"], values["osl"] = merged.mean_input_tokens, merged.mean_output_tokens
            self.local_share = merged.local_prefilled / merged.completed
            self.local_isl = merged.mean_local_input_tokens
            self.cached = merged.mean_cached_input_tokens
        self.forecaster.observe(values)
        return True

    def _forecast_split(self, snapshot: ClusterSnapshot) -> Split | None:
        t0 = time.perf_counter()
        if not self._observe(snapshot.series):
            return None
        f = self.forecaster.forecast()
        isl, osl = f["isl"].calibrated, f["osl"].calibrated
        if isl <= 0 or osl <= 0:
            return None  # nothing completed yet: no lengths to plan with
        split = optimal_split(self.model, self.ctx, isl, osl, f["concurrency"].calibrated, f["rate"].calibrated,
                              self.params, local_share=self.local_share, local_isl=self.local_isl, cached=self.cached)
        self.last_split = split
        self.decision_s.append(time.perf_counter() - t0)
        return split


    def _forecast_report(self, target_prefill: int | None) -> PolicyReport:
        """The newest forecast (what the planner publishes as a ``forecast`` event and the engines'
        ``dopd-length`` batching takes its ISL from) and the wall time of the recent decisions."""
        split = self.last_split
        return PolicyReport(target_prefill=target_prefill, reason=split_line(split) if split is not None else "",
                            forecasts=True, forecast=split, forecast_decisions=len(self.decision_s),
                            forecast_recent_s=tuple(self.decision_s[-FORECAST_TIMES_KEPT:]))


class DopdScaling(_Forecasting):
    """DOPD's PD Manager for elastic clusters: replica counts from the forecast, burst fast path, step limit.

    Floors on scale-in (ours; the spec recommends a cool-down after a scale-out and a streak of lower results
    before a scale-in, B11 item 7). Neither the periodic target nor the GPU budget, when it makes one role give way
    to the other, takes a role below

    - its current count while it is held: from any scale-out of the role until its replicas have all been
      ready for ``scale_in_after`` intervals, the time a lower forecast must persist before the periodic path
      believes it. Until then the load observed is not yet the load on the new replicas, so a lower count
      says nothing about whether they are needed; and a stop takes a starting replica first, so removing one
      wastes its start. The hold follows the replicas' own status, not an assumed start time;
    - the fast path's own count on the current measurements: ceil(queued prompts / ``queue_per_prefill``)
      prefill, ceil(ready decode instances x mean KV use / ``kv_high``) decode. Below it the fast path adds
      the replicas straight back: the measurement contradicts the lower count.

    A lower result below a floor does not count towards the streak. Without the floors a lower forecast, or
    the budget trading a GPU to the other role, stops the fast path's replicas while they start and the fast
    path adds them back a second later: starts that never serve.
    """

    name = "dopd"
    note = "dopd: ARIMA forecast of ISL/OSL/concurrency -> optimal P:D counts (Eq. 11-14), burst fast path"

    def __init__(self, model: LatencyModel, ctx: PolicyContext, params: DopdParams | None = None) -> None:
        super().__init__(model, ctx, params)
        self.interval_s = min(self.params.interval_s, 1.0)  # the fast path looks every second
        self._next_periodic = -math.inf
        self._lower_streak = {"prefill": 0, "decode": 0}
        self._held_until = {"prefill": -math.inf, "decode": -math.inf}  # no scale-in of the role before

    def report(self) -> PolicyReport:
        return self._forecast_report(None)  # its targets are replica counts (ScalingTarget), not a split

    def decide(self, snapshot: ClusterSnapshot, now_s: float) -> ScalingTarget | None:
        n_p, n_d = len(active(snapshot, "prefill")), len(active(snapshot, "decode"))
        floor_p, floor_d = self._floors(snapshot, now_s, n_p, n_d)
        target = self._burst(snapshot, n_p, n_d, floor_p, floor_d)
        if target is None:
            target = self._periodic(snapshot, now_s, n_p, n_d, floor_p, floor_d)
        if target is not None:
            self._hold_grown(now_s, target.prefill > n_p, target.decode > n_d)
        return target

    def _periodic(self, snapshot: ClusterSnapshot, now_s: float, n_p: int, n_d: int, floor_p: int,
                  floor_d: int) -> ScalingTarget | None:
        if now_s < self._next_periodic:
            return None
        self._next_periodic = now_s + self.params.interval_s
        split = self._forecast_split(snapshot)
        if split is None:
            return None
        prefill = self._step("prefill", n_p, max(split.prefill, floor_p))
        decode = self._step("decode", n_d, max(split.decode, floor_d))
        prefill, decode = self._fit(prefill, decode, floor_p, floor_d)
        if (prefill, decode) == (n_p, n_d):
            return None
        return ScalingTarget(prefill=prefill, decode=decode,
                             reason=f"dopd: ISL {split.isl:.0f} OSL {split.osl:.0f} C {split.concurrency:.1f} "
                                    f"rate {split.rate_rps:.1f}/s "
                                    f"-> R* {split.ratio:.2f}, N_d {split.n_d}")

    def _step(self, role: str, have: int, want: int) -> int:
        """At most ``max_step`` per decision; scale in only after ``scale_in_after`` lower results in a row."""
        if want < have:
            self._lower_streak[role] += 1
            if self._lower_streak[role] < self.params.scale_in_after:
                return have
        else:
            self._lower_streak[role] = 0
        return have + max(-self.params.max_step, min(self.params.max_step, want - have))

    def _hold_grown(self, now_s: float, prefill: bool, decode: bool) -> None:
        """Hold the roles that grew (or still have a replica starting) for ``scale_in_after`` intervals from now."""
        until = now_s + self.params.scale_in_after * self.params.interval_s
        if prefill:
            self._held_until["prefill"] = max(self._held_until["prefill"], until)
        if decode:
            self._held_until["decode"] = max(self._held_until["decode"], until)

    def _floors(self, snapshot: ClusterSnapshot, now_s: float, n_p: int, n_d: int) -> tuple[int, int]:
        """The counts below which the roles may not be taken now (the class docstring), at most what they have."""
        ready = [i for i in snapshot.instances if i.info.status == "ready"]
        queued = sum(_queued(i) for i in ready if i.info.role == "prefill")
        kv_used = sum(i.load.token_usage for i in ready if i.info.role == "decode" and i.load)  # instances' worth
        starting = {i.info.role for i in snapshot.instances if i.info.status == "starting"}
        self._hold_grown(now_s, "prefill" in starting, "decode" in starting)
        need_p = math.ceil(queued / self.params.queue_per_prefill)
        need_d = math.ceil(kv_used / self.params.kv_high)
        floor_p = n_p if now_s < self._held_until["prefill"] else min(n_p, need_p)
        floor_d = n_d if now_s < self._held_until["decode"] else min(n_d, need_d)
        return floor_p, floor_d

    def _fit(self, prefill: int, decode: int, floor_p: int, floor_d: int) -> tuple[int, int]:
        """``fit_budget``, except that a role it shrinks to make room for the other keeps its floor."""
        prefill, decode = fit_budget(prefill, decode, self.ctx)
        cap = self.ctx.max_instances
        if prefill < floor_p:  # the floors fit (each is at most what the role has): at most one is broken
            prefill, decode = floor_p, min(decode, cap - floor_p)
        elif decode < floor_d:
            prefill, decode = min(prefill, cap - floor_d), floor_d
        return prefill, decode

    def _burst(self, snapshot: ClusterSnapshot, n_p: int, n_d: int, floor_p: int, floor_d: int) -> ScalingTarget | None:
        prefills = [i for i in snapshot.instances if i.info.role == "prefill" and i.info.status == "ready"]
        decodes = [i for i in snapshot.instances if i.info.role == "decode" and i.info.status == "ready"]
        if not prefills or not decodes:
            return None
        queued = sum(_queued(i) for i in prefills)
        kv = sum(i.load.token_usage for i in decodes if i.load) / len(decodes)
        add_p = add_d = 0
        if queued / n_p > self.params.queue_per_prefill:
            add_p = min(self.params.max_step, math.ceil(queued / self.params.queue_per_prefill) - n_p)
        if kv > self.params.kv_high:
            # The KV the ready instances hold, spread at kv_high: a starting instance holds none yet, so the
            # count is len(decodes), not n_d (with n_d, each second of a start would add another replica).
            add_d = min(self.params.max_step, math.ceil(len(decodes) * kv / self.params.kv_high) - n_d)
        if add_p <= 0 and add_d <= 0:
            return None
        prefill, decode = self._fit(n_p + max(add_p, 0), n_d + max(add_d, 0), floor_p, floor_d)
        if (prefill, decode) == (n_p, n_d):
            return None
        return ScalingTarget(prefill=prefill, decode=decode,
                             reason=f"dopd burst: {queued} prompts queued, decode KV {kv:.0%}")


class DopdPools(_Forecasting):
    """DOPD for a fixed GPU count: the instances split R*:1 between prefill and decode, by flips."""

    name = "dopd"
    note = "dopd: ARIMA forecast of ISL/OSL -> optimal P:D ratio (Eq. 14) on the instances there are, by flips"

    def __init__(self, model: LatencyModel, ctx: PolicyContext, params: DopdParams | None = None) -> None:
        super().__init__(model, ctx, params)
        self.target_prefill: int | None = None

    def update_target(self, snapshot: ClusterSnapshot) -> int | None:
        """Recompute the wanted number of prefill instances from a fresh forecast (None: nothing to go on)."""
        split = self._forecast_split(snapshot)
        if split is not None:
            total = sum(1 for i in snapshot.instances if i.info.role in ("prefill", "decode"))
            self.target_prefill = split_of(total, split.ratio, self.ctx.min_per_role, self.target_prefill,
                                           self.params.dead_band)[0]
        return self.target_prefill

    def report(self) -> PolicyReport:
        return self._forecast_report(self.target_prefill)

    def decide(self, snapshot: ClusterSnapshot, now_s: float) -> PoolDecision | None:
        target = self.update_target(snapshot)
        if target is None:
            return None
        return PoolDecision(changes=flip_towards(snapshot, target, "dopd"))


def flip_towards(snapshot: ClusterSnapshot, target_prefill: int, who: str) -> list[RoleChange]:
    """One flip that moves the prefill count towards ``target_prefill``; none while a flip is in progress.

    The instance that flips is the least loaded of the surplus role, so it drains soonest.
    """
    if any(i.info.status in ("draining", "switching") for i in snapshot.instances):
        return []
    ready = [i for i in snapshot.instances if i.info.status == "ready" and i.load is not None]
    prefills = [i for i in ready if i.info.role == "prefill"]
    decodes = [i for i in ready if i.info.role == "decode"]
    if len(prefills) < target_prefill and len(decodes) > 1:
        victim = min(decodes, key=lambda i: (_load(i), i.info.instance_id))
        return [RoleChange(instance_id=victim.info.instance_id, new_role="prefill",
                           reason=f"{who}: {len(prefills)} prefill instances, target {target_prefill}")]
    if len(prefills) > target_prefill and len(prefills) > 1:
        victim = min(prefills, key=lambda i: (_queued(i), i.info.instance_id))
        return [RoleChange(instance_id=victim.info.instance_id, new_role="decode",
                           reason=f"{who}: {len(prefills)} prefill instances, target {target_prefill}")]
    return []


def _queued(inst: InstanceLoad) -> int:
    """Prompts waiting for or in this prefill engine's compute (not those waiting for decode KV, nor those
    whose KV is being sent)."""
    load = inst.load
    return 0 if load is None else load.compute_waiting_reqs + load.num_running_reqs


def _load(inst: InstanceLoad) -> int:
    load = inst.load
    if load is None:
        return 0
    return load.num_running_tokens if load.num_running_tokens is not None else load.num_used_tokens
