"""What a controller that switches among fixed configurations could reach with hindsight.

Poise's controller picks, over time, among the configurations a cluster can run: the fixed P:D splits and
colocated serving. :mod:`loadgen.goodput_bound` bounds what *any* policy could reach; this asks the narrower
question the controller answers to: had it known the whole trace in advance and switched for free, how many
requests would the best configuration of each window have served in time?

Every configuration is simulated over the whole run at the same rate (the same arrivals: the yardstick is
deterministic). The counted part of the run is cut into windows by arrival time; in each window the oracle
takes the configuration that met the most SLOs there, and its attainment is those hits summed over the
windows. It is an estimate, not a bound, and an optimistic one for a controller: switching costs nothing
(a real flip drains an instance and a move into colocated serving restarts one), and each configuration's
window is what it served after running that configuration all along, not after the oracle's previous
choice (a backlog one configuration left behind can make the next window better or worse). With one window
it is the best fixed configuration in hindsight; shorter windows let it follow the load more closely.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from loadgen.metrics import slo_hits
from loadgen.records import RequestRecord
from loadgen.slo import SLO

#: Hits and requests of one configuration in one window.
WindowCount = tuple[int, int]


def window_hits(records: Sequence[RequestRecord], slo: SLO, start_s: float, window_s: float) -> list[WindowCount]:
    """(requests meeting ``slo``, requests) per window of ``window_s`` by arrival, from ``start_s`` (requests
    arriving earlier are the warm-up and not counted). A failed request counts as a miss, as in the summary."""
    if window_s <= 0:
        raise ValueError(f"window_s must be > 0, got {window_s}")
    counted = [r for r in records if r.arrival_s >= start_s]
    if not counted:
        return []
    windows: list[list[RequestRecord]] = [[] for _ in range(int((max(r.arrival_s for r in counted) - start_s) // window_s) + 1)]
    for r in counted:
        windows[int((r.arrival_s - start_s) // window_s)].append(r)
    return [(slo_hits(w, lambda _: slo)[2], len(w)) for w in windows]


@dataclass(frozen=True)
class OracleChoice:
    """The switching oracle at one rate: its attainment, and which configuration it ran in each window."""

    attainment: float
    schedule: list[str]  # per window, a configuration with the most hits (on a tie, the one already running)
    switches: int  # how often the schedule changes configuration
    best_fixed: str  # the best single configuration over the whole run
    best_fixed_attainment: float


def switching_oracle(per_config: Mapping[str, Sequence[WindowCount]]) -> OracleChoice:
    """The oracle over ``per_config`` (configuration -> :func:`window_hits` of its run at one rate).

    Every configuration must have served the same requests: the windows' sizes must agree."""
    if not per_config:
        raise ValueError("no configurations to choose from")
    names = list(per_config)
    sizes = [n for _, n in per_config[names[0]]]
    for name in names[1:]:
        if [n for _, n in per_config[name]] != sizes:
            raise ValueError(f"configurations {names[0]} and {name} did not serve the same requests "
                             "(their windows differ): simulate them on the same workload, rate and seed")
    total = sum(sizes)
    if total == 0:
        return OracleChoice(0.0, [], 0, names[0], 0.0)
    fixed = {name: sum(h for h, _ in per_config[name]) for name in names}
    best = max(names, key=lambda name: fixed[name])
    schedule: list[str] = []
    for i in range(len(sizes)):
        top = max(per_config[name][i][0] for name in names)
        tied = [name for name in names if per_config[name][i][0] == top]
        # A tie switches nothing: stay where the last window was, else run the best fixed configuration.
        keep = schedule[-1] if schedule else best
        schedule.append(keep if keep in tied else best if best in tied else tied[0])
    hits = sum(per_config[name][i][0] for i, name in enumerate(schedule))
    switches = sum(a != b for a, b in zip(schedule, schedule[1:], strict=False))
    return OracleChoice(hits / total, schedule, switches, best, fixed[best] / total)


def grid_goodput(attainment: Mapping[float, float], target: float) -> float:
    """The highest rate of ``attainment`` (rate -> attainment) at which it and every lower rate reach
    ``target``: the yardstick's goodput on a fixed grid. 0.0 when the lowest rate misses."""
    good = 0.0
    for rate in sorted(attainment):
        if attainment[rate] < target:
            break
        good = rate
    return good


def rate_grid(low: float, high: float, points: int) -> list[float]:
    """``points`` rates from ``low`` to ``high``, evenly spaced on a log scale and rounded up to 1/64 (finer
    than the goodput search's steps, and short to write), so the last is at or above ``high``."""
    if points < 2 or high <= low:
        return [math.ceil(low * 64) / 64]
    ratio = math.log(high / low) / (points - 1)
    return sorted({math.ceil(low * math.exp(ratio * k) * 64 - 1e-9) / 64 for k in range(points)})
