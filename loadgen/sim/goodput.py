"""Goodput: the highest request rate at which SLO attainment, and attainment at every lower rate tried, stays
at or above a target (90%, as Arrow).

What "attainment" means is the yardstick's ``criterion``. ``work`` (the default) asks for the target both of
requests and of tokens (prompt + output of the requests served within SLO over all arrived), and for no
prompt-length quartile below ``quartile_floor``: a policy cannot pass by refusing or starving the longest
prompts, which carry most of the work. ``requests`` is the papers' request count alone, kept, labelled, to
compare with them.

The yardstick is sustained serving (:class:`Yardstick`): the whole trace, its load raised at natural time
(``loadgen.rate_scaling``: ``s`` times the trace's own rate curve, an hour stays an hour), and the first
``warmup_s`` left out of the attainment: the cluster starts empty, which flatters every policy, and the
adaptive ones start with no history to plan from, which no long-running cluster has. Arrow's timestamp
division stays available (``rate_mode="compress"``, no warm-up) to compare with the papers.

The search grows the scale geometrically until attainment drops below the target, then bisects between the
last passing and the first failing scale; every scale it passes lies below every scale it failed, so a
cliff below the goodput cannot hide. Attainment need not fall monotonically with the rate (a policy can
flip into a better split at a higher load): ``probe_above`` more scales past the first failure are tried,
and a pass there marks the curve non-monotone. Every simulated point is kept, so the curves can be plotted.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal

from loadgen.rate_scaling import RateMode
from loadgen.sim.baselines import PolicyMix, make_mix
from loadgen.sim.cluster import SimCosts
from loadgen.sim.control import ControlParams
from loadgen.sim.run import simulate
from loadgen.slo import SLO, SLOClasses
from loadgen.workload import Workload
from shared.latency import LatencyModel
from shared.protocol.refusal import CLIENT_MAX_RETRIES


@dataclass(frozen=True)
class Yardstick:
    """How load is raised and what is counted (the module docstring says why these defaults)."""

    rate_mode: RateMode = "natural"
    warmup_s: float = 120.0
    seed: int = 0
    criterion: Literal["work", "requests"] = "work"
    client_retries: int = CLIENT_MAX_RETRIES  # clients send a refused request again, as the openai client does
    quartile_floor: float = 0.8  # with ``work``: the least attainment any prompt-length quartile may have

    def passes(self, point: CurvePoint, target: float) -> bool:
        """Whether ``point`` meets ``target`` on this yardstick's criterion."""
        if point.attainment < target:
            return False
        if self.criterion == "requests":
            return True
        return point.token_attainment >= target and point.min_quartile_attainment >= self.quartile_floor

    def warmup_for(self, workload: Workload, scale: float) -> float:
        """The warm-up for one run: ``warmup_s``, but at most a fifth of the run (a short slice keeps most of
        its requests)."""
        span = workload.duration_s / scale if self.rate_mode == "compress" else workload.duration_s
        return min(self.warmup_s, 0.2 * span)

    def describe(self) -> str:
        if self.rate_mode == "compress":
            how = "timestamps divided by the scale (Arrow's method)"
        else:
            how = "natural time (s x the trace's rate curve)"
        counted = (f"requests and tokens in time, no prompt-length quartile below {100 * self.quartile_floor:g}%"
                   if self.criterion == "work" else "requests in time (the papers' count)")
        warm = f"; first {self.warmup_s:g} s not counted" if self.warmup_s > 0 else ""
        retry = (f"; clients retry a refusal {self.client_retries} times after Retry-After" if self.client_retries
                 else "; refused requests are not sent again")
        return f"{how}{warm}{retry}; goodput counts {counted}"


#: Arrow's yardstick: timestamps divided by the scale, every request counted (to compare with the papers).
COMPRESSED = Yardstick(rate_mode="compress", warmup_s=0.0, criterion="requests", client_retries=0)


@dataclass(frozen=True)
class CurvePoint:
    rate_scale: float
    rate_rps: float
    attainment: float
    ttft_p90_s: float | None
    tpot_p90_s: float | None
    mean_instances: float  # GPU-seconds / makespan: what the run kept provisioned (less than the budget if it scaled)
    ttft_p99_s: float | None = None
    flips: int = 0
    flips_called_off: int = 0
    max_flips_per_instance_5min: int = 0  # the most flips one instance began in any 5 minutes
    sim_speed: float | None = None  # simulated seconds per wall second
    # The work view (loadgen.metrics.WorkView): tokens in time, refusals, late answers, the worst quartile.
    token_attainment: float = 0.0
    refused_share: float = 0.0
    refused_token_share: float = 0.0
    late_share: float = 0.0
    min_quartile_attainment: float = 0.0
    retries: int = 0


@dataclass
class GoodputResult:
    policy: str
    description: str
    goodput_scale: float  # 0.0: the target is missed even at the lowest rate tried
    goodput_rps: float
    points: list[CurvePoint] = field(default_factory=list)
    capped: bool = False  # the target held up to the highest scale tried: goodput is at least that
    non_monotone: bool = False  # a scale above a failing one passed: the curve has a dip below its goodput's top
    yardstick: Yardstick = field(default_factory=Yardstick)


def curve_point(workload: Workload, mix: PolicyMix, model: LatencyModel, slo: SLO, scale: float, *,
                costs: SimCosts | None = None, slo_classes: SLOClasses | None = None,
                control: ControlParams | None = None, yardstick: Yardstick | None = None) -> CurvePoint:
    """One simulated point of ``mix``'s attainment-vs-rate curve on ``yardstick``."""
    y = yardstick or Yardstick()
    result = simulate(workload, mix, model, slo, rate_scale=scale, costs=costs, slo_classes=slo_classes,
                      control=control, rate_mode=y.rate_mode, warmup_s=y.warmup_for(workload, scale), seed=y.seed,
                      client_retries=y.client_retries)
    s = result.summary
    lc = result.config["lifecycle"]
    gpus = lc["gpu_seconds"] / result.wall_s if result.wall_s > 0 else float(len(mix.roles))
    return CurvePoint(scale, workload.mean_rate_rps * scale, s.slo_attainment, s.ttft_p90_s, s.tpot_p90_s, gpus,
                      ttft_p99_s=s.ttft_p99_s, flips=int(lc["flips"]), flips_called_off=int(lc["flips_called_off"]),
                      max_flips_per_instance_5min=max_flips_in_window(lc["events"], 300.0),
                      sim_speed=result.config["sim_seconds_per_wall_second"], token_attainment=s.token_attainment,
                      refused_share=s.refused_share, refused_token_share=s.refused_token_share,
                      late_share=s.late_share, min_quartile_attainment=min(s.quartile_attainment, default=0.0),
                      retries=s.retries)


def max_flips_in_window(events: list[list[object]], window_s: float) -> int:
    """The most flips any one instance began within ``window_s`` (from the lifecycle's event log)."""
    starts: dict[str, list[float]] = {}
    for t, instance, what in events:
        if str(what).startswith("drain to flip"):
            starts.setdefault(str(instance), []).append(float(t))  # type: ignore[arg-type]
    best = 0
    for times in starts.values():
        lo = 0
        for hi, t in enumerate(times):
            while t - times[lo] >= window_s:
                lo += 1
            best = max(best, hi - lo + 1)
    return best


@dataclass
class ScaleSearch:
    """Where a search over rate scales ended (see :func:`search_scales`)."""

    goodput_scale: float
    capped: bool
    non_monotone: bool


def search_scales(passes: Callable[[float], bool], *, start: float = 1.0, max_scale: float = 256.0,
                  bisections: int = 6, probe_above: int = 0) -> ScaleSearch:
    """The highest scale for which ``passes`` holds there and at every lower scale tried.

    Doubles from ``start`` until a scale fails (or halves until one passes), then bisects between the last
    pass and the first failure, so no scale it reports passing lies above one that failed. ``probe_above``
    scales past the first failure (x1.25 apart) are tried too; a pass there marks the curve non-monotone.
    """
    lo: float | None = None  # highest scale known to pass
    hi: float | None = None  # lowest scale known to fail
    if passes(start):
        lo = start
        while lo * 2 <= max_scale:  # grow until the target is missed (or the cap: goodput is then >= the cap)
            if not passes(lo * 2):
                hi = lo * 2
                break
            lo *= 2
    else:
        hi = start
        probe = start / 2
        while probe >= start / 64:  # shrink until the target is met
            if passes(probe):
                lo = probe
                break
            hi = probe
            probe /= 2
    capped = lo is not None and hi is None
    if lo is not None and hi is not None:
        for _ in range(bisections):
            mid = (lo + hi) / 2
            if passes(mid):
                lo = mid
            else:
                hi = mid
    non_monotone = False
    if hi is not None:  # the lowest failing scale
        for k in range(1, probe_above + 1):
            non_monotone |= passes(hi * 1.25**k)
    return ScaleSearch(lo or 0.0, capped, non_monotone)


def search_goodput(workload: Workload, build: Callable[[], PolicyMix], model: LatencyModel, slo: SLO, *,
                   target: float = 0.9, start: float = 1.0, max_scale: float = 256.0,
                   bisections: int = 6, costs: SimCosts | None = None,
                   slo_classes: SLOClasses | None = None, control: ControlParams | None = None,
                   yardstick: Yardstick | None = None, probe_above: int = 0,
                   progress: Callable[[CurvePoint], None] | None = None) -> GoodputResult:
    """Goodput of the mix ``build`` makes (a fresh one per run: policies keep state), by :func:`search_scales`
    on ``yardstick``. With ``slo_classes`` each request is judged against its class's SLO; ``control`` tunes
    the control loop; ``progress`` sees each point as it is simulated."""
    mix = build()
    y = yardstick or Yardstick()
    result = GoodputResult(mix.name, mix.description, 0.0, 0.0, yardstick=y)

    def passes(scale: float) -> bool:
        point = curve_point(workload, build(), model, slo, scale, costs=costs, slo_classes=slo_classes,
                            control=control, yardstick=y)
        result.points.append(point)
        if progress is not None:
            progress(point)
        return y.passes(point, target)

    found = search_scales(passes, start=start, max_scale=max_scale, bisections=bisections, probe_above=probe_above)
    result.goodput_scale, result.capped, result.non_monotone = found.goodput_scale, found.capped, found.non_monotone
    result.goodput_rps = found.goodput_scale * workload.mean_rate_rps
    result.points.sort(key=lambda p: p.rate_scale)
    return result


def at_goodput(result: GoodputResult) -> CurvePoint | None:
    """The simulated point at the goodput scale (None when the target was never met)."""
    return next((p for p in result.points if p.rate_scale == result.goodput_scale), None)


def static_best(workload: Workload, instances: int, model: LatencyModel, slo: SLO, *,
                coarse_bisections: int = 2, **search: object) -> GoodputResult:
    """The best fixed P:D split for this trace, found by trying every one (an oracle no operator has).

    Every split is searched coarsely (``coarse_bisections``), then the two best again at the full resolution:
    on whole traces at natural time a full search of every split costs more than the rest of a comparison.
    """
    full = int(search.pop("bisections", 6))  # type: ignore[call-overload]
    coarse: list[tuple[float, str]] = []
    for p in range(1, instances):
        split = f"{p}P{instances - p}D"
        build = functools.partial(make_mix, "static-minload", instances, split)
        r = search_goodput(workload, build, model, slo, bisections=min(full, coarse_bisections), **search)  # type: ignore[arg-type]
        coarse.append((r.goodput_scale, split))
    assert coarse, "static-best needs at least 2 instances"
    best: GoodputResult | None = None
    for _, split in sorted(coarse, reverse=True)[:2]:
        build = functools.partial(make_mix, "static-minload", instances, split)
        r = search_goodput(workload, build, model, slo, bisections=full, **search)  # type: ignore[arg-type]
        if best is None or r.goodput_scale > best.goodput_scale:
            best = r
    assert best is not None
    best.policy = "static-best"
    best.description = f"best fixed split: {best.description}"
    return best
