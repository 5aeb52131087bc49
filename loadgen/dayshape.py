"""A load that rises and falls: a real trace time-warped onto a day-shaped rate curve.

The issue's DOPD comparison needs load that moves on the scale of minutes, which the papers' one-hour
traces hardly do. :func:`day_shape` keeps a trace's requests, their order, lengths and burstiness, and
re-times them so the request rate follows ``low + (high - low) * (1 - cos(2 pi t / period)) / 2`` times the
trace's own rate: quiet at the start of each period (night), busiest halfway (noon). :func:`repeat` chains
copies of a trace to make a longer day. Deterministic; no randomness is added.
"""

from __future__ import annotations

import math

import msgspec
import numpy as np

from loadgen.workload import TraceRequest, Workload


def rate_multiplier(t_s: float, period_s: float, low: float, high: float) -> float:
    return low + (high - low) * (1.0 - math.cos(2.0 * math.pi * t_s / period_s)) / 2.0


def day_shape(workload: Workload, period_s: float, *, low: float = 0.2, high: float = 1.0) -> Workload:
    """Re-time ``workload`` so its rate is the trace's times :func:`rate_multiplier` (``0 < low <= high``).

    An arrival at trace time ``t`` moves to the time ``T`` at which the warped cumulative rate
    ``M(T) = integral of the multiplier from 0 to T`` reaches ``t``: where the multiplier is 0.2, the same
    requests are spread over five times as long.
    """
    if not 0 < low <= high:
        raise ValueError(f"day shape needs 0 < low <= high, got low={low}, high={high}")
    if not period_s > 0:
        raise ValueError(f"period_s must be > 0, got {period_s}")
    if not workload.requests:
        return workload
    end = workload.requests[-1].arrival_s
    horizon = end / low + period_s  # M(T) >= low * T, so T never exceeds end / low
    grid = np.linspace(0.0, horizon, max(1000, int(horizon / (period_s / 2000))))
    mult = low + (high - low) * (1.0 - np.cos(2.0 * np.pi * grid / period_s)) / 2.0
    cumulative = np.concatenate(([0.0], np.cumsum((mult[1:] + mult[:-1]) / 2.0 * np.diff(grid))))
    times = np.interp([r.arrival_s for r in workload.requests], cumulative, grid)
    warped = [msgspec.structs.replace(r, arrival_s=float(t)) for r, t in zip(workload.requests, times, strict=True)]
    return Workload(name=workload.name, requests=warped)


def repeat(workload: Workload, copies: int) -> Workload:
    """``copies`` back-to-back copies of ``workload`` (indices shifted so each request stays unique)."""
    if copies < 1:
        raise ValueError(f"copies must be >= 1, got {copies}")
    if not workload.requests:
        return workload
    span = workload.requests[-1].arrival_s + (workload.mean_rate_rps and 1.0 / workload.mean_rate_rps)
    stride = max(r.index for r in workload.requests) + 1
    out: list[TraceRequest] = []
    for k in range(copies):
        out.extend(msgspec.structs.replace(r, arrival_s=r.arrival_s + k * span, index=r.index + k * stride)
                   for r in workload.requests)
    return Workload(name=workload.name, requests=out)
