"""The monitor's rolling series: request events and load samples folded into one :class:`SeriesPoint` per interval.

Pure and synchronous (no clock, no I/O): the caller feeds events and loads as they arrive and calls
:meth:`SeriesBuilder.roll` at each interval boundary with the wall-clock time. The simulator can drive the
same class with virtual time.

What an interval counts:

- ``arrivals``: requests whose :class:`RequestEvent` reached the monitor in the interval, whatever their
  outcome. The gateway reports a request once, when it finishes, so this series trails true arrivals by
  about one request latency; the total over time is exact.
- ``completed`` and the means/percentiles: the subset with ``status == "ok"``; ``mean_*_tokens`` are 0 and
  the p90s ``None`` when nothing completed (or no latency was reported).
- ``mean_input_tokens_sq``, ``mean_output_tokens_sq``, ``mean_input_output_tokens``, ``mean_input_tokens_cube``,
  ``mean_input_sq_output_tokens``: higher moments of the completed requests' lengths (what prefill work, decode
  work and the KV a prompt holds while it is prefilled depend on).
- ``mean_cached_input_tokens`` and ``..._sq``: the prompt tokens prefill instances served from their prefix
  cache (the gateway's events carry the engines' counts), per completed request.
- ``local_prefilled`` and ``mean_local_input_tokens``: the completed requests that no prefill instance
  prefilled (``prefill_id`` None: DOPD's local prefill on the decode instance, or a colocated engine).
- ``mean_running_reqs``: for each instance, the mean of ``num_running_reqs`` over its healthy load samples in
  the interval, summed over instances: the cluster's mean concurrency.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

from shared.protocol import LoadReport, RequestEvent, SeriesPoint

#: The per-request means of a SeriesPoint, weighted by ``completed`` when points are merged.
_COMPLETED_MEANS = ("mean_input_tokens", "mean_output_tokens", "mean_input_tokens_sq", "mean_output_tokens_sq",
                    "mean_input_output_tokens", "mean_input_tokens_cube", "mean_input_sq_output_tokens",
                    "mean_cached_input_tokens", "mean_cached_input_tokens_sq")


def merge_points(points: Sequence[SeriesPoint]) -> SeriesPoint | None:
    """Several consecutive intervals as one (None for none): counts summed, the completed requests' means
    weighted by how many completed, concurrency averaged; the p90s cannot be merged and are None. What a
    policy planning on a window longer than one interval reads."""
    if not points:
        return None
    completed = sum(p.completed for p in points)
    local = sum(p.local_prefilled for p in points)
    span = sum(p.interval_s for p in points)
    arrivals = sum(p.arrivals for p in points)

    def weighted(field: str) -> float:
        return sum(getattr(p, field) * p.completed for p in points) / completed if completed else 0.0

    return SeriesPoint(
        start_unix_s=points[0].start_unix_s, interval_s=span, arrivals=arrivals,
        arrival_rate_rps=arrivals / span if span > 0 else 0.0, completed=completed,
        mean_running_reqs=sum(p.mean_running_reqs for p in points) / len(points), ttft_p90_s=None, tpot_p90_s=None,
        local_prefilled=local,
        mean_local_input_tokens=sum(p.mean_local_input_tokens * p.local_prefilled for p in points) / local if local else 0.0,
        **{field: weighted(field) for field in _COMPLETED_MEANS})


def percentile(values: list[float], q: float) -> float | None:
    """Nearest-rank percentile (``q`` in [0, 100]); ``None`` for no values."""
    if not values:
        return None
    ordered = sorted(values)
    rank = max(1, math.ceil(q / 100.0 * len(ordered)))
    return ordered[min(rank, len(ordered)) - 1]


@dataclass
class _Interval:
    arrivals: int = 0
    completed: int = 0
    input_tokens: int = 0
    output_tokens: int = 0
    local: int = 0  # completed requests prefilled where they were decoded (no prefill instance)
    local_input_tokens: int = 0
    input_sq: float = 0.0
    output_sq: float = 0.0
    input_output: float = 0.0
    input_cube: float = 0.0
    input_sq_output: float = 0.0
    cached: float = 0.0  # prompt tokens prefill instances found cached, and their squares
    cached_sq: float = 0.0
    ttfts: list[float] = field(default_factory=list)
    tpots: list[float] = field(default_factory=list)
    running_sum: dict[str, float] = field(default_factory=dict)  # instance -> sum of running reqs samples
    running_n: dict[str, int] = field(default_factory=dict)  # instance -> number of samples


class SeriesBuilder:
    """Accumulates one open interval starting at ``start_unix_s``; :meth:`roll` closes it."""

    def __init__(self, start_unix_s: float) -> None:
        self.start_unix_s = start_unix_s
        self._cur = _Interval()

    def add_event(self, event: RequestEvent) -> None:
        cur = self._cur
        cur.arrivals += 1
        if event.status != "ok":
            return
        cur.completed += 1
        cur.input_tokens += event.input_tokens
        cur.output_tokens += event.output_tokens
        cur.input_sq += float(event.input_tokens) ** 2
        cur.output_sq += float(event.output_tokens) ** 2
        cur.input_output += float(event.input_tokens) * event.output_tokens
        cur.input_cube += float(event.input_tokens) ** 3
        cur.input_sq_output += float(event.input_tokens) ** 2 * event.output_tokens
        if event.prefill_id is None:
            cur.local += 1
            cur.local_input_tokens += event.input_tokens
        else:
            cur.cached += event.cached_tokens
            cur.cached_sq += float(event.cached_tokens) ** 2
        if event.ttft_s is not None:
            cur.ttfts.append(event.ttft_s)
        if event.tpot_s is not None:
            cur.tpots.append(event.tpot_s)

    def add_load(self, load: LoadReport) -> None:
        if not load.healthy:
            return
        cur = self._cur
        cur.running_sum[load.instance_id] = cur.running_sum.get(load.instance_id, 0.0) + load.num_running_reqs
        cur.running_n[load.instance_id] = cur.running_n.get(load.instance_id, 0) + 1

    def roll(self, now_unix_s: float) -> SeriesPoint:
        """Close the interval ``[start, now)``, return its point and open the next one at ``now``."""
        cur = self._cur
        interval_s = max(0.0, now_unix_s - self.start_unix_s)
        running = sum(cur.running_sum[i] / cur.running_n[i] for i in cur.running_sum)
        point = SeriesPoint(
            start_unix_s=self.start_unix_s,
            interval_s=interval_s,
            arrivals=cur.arrivals,
            arrival_rate_rps=cur.arrivals / interval_s if interval_s > 0 else 0.0,
            completed=cur.completed,
            mean_input_tokens=cur.input_tokens / cur.completed if cur.completed else 0.0,
            mean_output_tokens=cur.output_tokens / cur.completed if cur.completed else 0.0,
            mean_running_reqs=running,
            ttft_p90_s=percentile(cur.ttfts, 90),
            tpot_p90_s=percentile(cur.tpots, 90),
            local_prefilled=cur.local,
            mean_local_input_tokens=cur.local_input_tokens / cur.local if cur.local else 0.0,
            mean_input_tokens_sq=cur.input_sq / cur.completed if cur.completed else 0.0,
            mean_output_tokens_sq=cur.output_sq / cur.completed if cur.completed else 0.0,
            mean_input_output_tokens=cur.input_output / cur.completed if cur.completed else 0.0,
            mean_input_tokens_cube=cur.input_cube / cur.completed if cur.completed else 0.0,
            mean_input_sq_output_tokens=cur.input_sq_output / cur.completed if cur.completed else 0.0,
            mean_cached_input_tokens=cur.cached / cur.completed if cur.completed else 0.0,
            mean_cached_input_tokens_sq=cur.cached_sq / cur.completed if cur.completed else 0.0,
        )
        self.start_unix_s = now_unix_s
        self._cur = _Interval()
        return point
