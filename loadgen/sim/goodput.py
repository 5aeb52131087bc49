"""Goodput: the highest request rate at which SLO attainment stays at or above a target (90%, as Arrow).

The rate is a multiple of the trace's own rate (timestamps divided by the scale, Arrow's method). Attainment
falls as the rate rises (not strictly: a simulated cluster can get lucky on one burst), so the search grows
the scale geometrically until attainment drops below the target, then bisects between the last passing and
the first failing scale. Every simulated point is kept, so the curves can be plotted.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, field

from loadgen.sim.baselines import PolicyMix, make_mix
from loadgen.sim.cluster import SimCosts
from loadgen.sim.control import ControlParams
from loadgen.sim.run import simulate
from loadgen.slo import SLO, SLOClasses
from loadgen.workload import Workload
from shared.latency import LatencyModel


@dataclass(frozen=True)
class CurvePoint:
    rate_scale: float
    rate_rps: float
    attainment: float
    ttft_p90_s: float | None
    tpot_p90_s: float | None
    mean_instances: float  # GPU-seconds / makespan: what the run kept provisioned (less than the budget if it scaled)


@dataclass
class GoodputResult:
    policy: str
    description: str
    goodput_scale: float  # 0.0: the target is missed even at the lowest rate tried
    goodput_rps: float
    points: list[CurvePoint] = field(default_factory=list)
    capped: bool = False  # the target held up to the highest scale tried: goodput is at least that


def _point(workload: Workload, mix: PolicyMix, model: LatencyModel, slo: SLO, scale: float,
           costs: SimCosts | None, slo_classes: SLOClasses | None, control: ControlParams | None) -> CurvePoint:
    result = simulate(workload, mix, model, slo, rate_scale=scale, costs=costs, slo_classes=slo_classes,
                      control=control)
    s = result.summary
    gpus = result.config["lifecycle"]["gpu_seconds"] / s.wall_s if s.wall_s > 0 else float(len(mix.roles))
    return CurvePoint(scale, workload.mean_rate_rps * scale, s.slo_attainment, s.ttft_p90_s, s.tpot_p90_s, gpus)


def search_goodput(workload: Workload, build: Callable[[], PolicyMix], model: LatencyModel, slo: SLO, *,
                   target: float = 0.9, start: float = 1.0, max_scale: float = 256.0,
                   bisections: int = 6, costs: SimCosts | None = None,
                   slo_classes: SLOClasses | None = None, control: ControlParams | None = None) -> GoodputResult:
    """Highest rate scale with attainment >= ``target``; ``build`` makes a fresh mix per run (policies keep state).
    With ``slo_classes`` each request is judged against its class's SLO; ``control`` tunes the control loop."""
    mix = build()
    result = GoodputResult(mix.name, mix.description, 0.0, 0.0)

    def run(scale: float) -> bool:
        point = _point(workload, build(), model, slo, scale, costs, slo_classes, control)
        result.points.append(point)
        return point.attainment >= target

    lo: float | None = None  # highest scale known to pass
    hi: float | None = None  # lowest scale known to fail
    if run(start):
        lo = start
        while lo * 2 <= max_scale:  # grow until the target is missed (or the cap: goodput is then >= the cap)
            if not run(lo * 2):
                hi = lo * 2
                break
            lo *= 2
    else:
        hi = start
        probe = start / 2
        while probe >= start / 64:  # shrink until the target is met
            if run(probe):
                lo = probe
                break
            hi = probe
            probe /= 2
    result.capped = lo is not None and hi is None
    if lo is not None and hi is not None:
        for _ in range(bisections):
            mid = (lo + hi) / 2
            if run(mid):
                lo = mid
            else:
                hi = mid
    lo = lo or 0.0
    result.goodput_scale = lo
    result.goodput_rps = lo * workload.mean_rate_rps
    result.points.sort(key=lambda p: p.rate_scale)
    return result


def at_goodput(result: GoodputResult) -> CurvePoint | None:
    """The simulated point at the goodput scale (None when the target was never met)."""
    return next((p for p in result.points if p.rate_scale == result.goodput_scale), None)


def static_best(workload: Workload, instances: int, model: LatencyModel, slo: SLO, **search: float) -> GoodputResult:
    """The best fixed P:D split for this trace, found by trying every one (an oracle no operator has)."""
    best: GoodputResult | None = None
    for p in range(1, instances):
        split = f"{p}P{instances - p}D"
        build = functools.partial(make_mix, "static-minload", instances, split)
        r = search_goodput(workload, build, model, slo, **search)  # type: ignore[arg-type]
        if best is None or r.goodput_scale > best.goodput_scale:
            best = r
    assert best is not None, "static-best needs at least 2 instances"
    best.policy = "static-best"
    best.description = f"best fixed split: {best.description}"
    return best
