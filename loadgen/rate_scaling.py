"""How a benchmark raises a workload's load: at natural time (the default) or by compressing time (Arrow's).

``natural`` keeps the trace's clock. At a factor ``s`` each request of the trace stays where it is, and
``s - 1`` more requests (on average: the integer part always, the fraction by a seeded coin) are drawn
around it: each at a uniform time in the request's own cell (halfway to its neighbours, at most
``max_jitter_s`` either side), carrying the (prompt, output) lengths of a trace request chosen at random
within ``mix_window_s`` of it. The arrival rate is then ``s`` times the trace's own rate curve, smoothed no
more than the trace's own gaps, and the length mix at every minute is that minute's mix, so an hour stays an
hour: a control loop meets the load shifts at the pace an operator would. Below 1x requests are thinned by
the same coin. At 1x the workload is returned unchanged.

A copy carries its source's prefix blocks (``hash_ids``) moved into a namespace of its own (copy ``j``: every
id plus ``j`` times the trace's id range): it is another user's request of the same shape, so it shares
prefixes with the other ``j``-th copies, never with the trace's own requests. Keeping the source's ids would
repeat a nearby prompt within seconds and let a prefix cache serve more than the trace ever reuses; the
namespaces err the other way (a system prompt every user shares is shared within each namespace only).

``compress`` divides every timestamp by ``s`` (Arrow's method, kept to compare with the papers): the same
requests in ``1/s`` of the time. At 20x a 10-minute slice lasts 30 s, so goodput then measures how much of a
burst an empty cluster absorbs, and control loops with 10-30 s periods barely act.

Deterministic: the same call gives the same workload on any machine (``random.Random`` only).
"""

from __future__ import annotations

import bisect
import math
import random
from typing import Literal

import msgspec

from loadgen.workload import TraceRequest, Workload

RateMode = Literal["natural", "compress"]
RATE_MODES: tuple[RateMode, ...] = ("natural", "compress")


def scale_load(workload: Workload, factor: float, mode: RateMode = "natural", *, seed: int = 0,
               max_jitter_s: float = 30.0, mix_window_s: float = 60.0) -> Workload:
    """``workload`` at ``factor`` times its request rate (see the module docstring for the two modes)."""
    if not factor > 0 or math.isinf(factor):
        raise ValueError(f"rate scale factor must be a finite number > 0, got {factor}")
    if mode == "compress":
        return workload.scale_rate(factor)
    if mode != "natural":
        raise ValueError(f"unknown rate mode {mode!r}; known: {', '.join(RATE_MODES)}")
    if factor == 1.0 or not workload.requests:
        return workload
    return _natural(workload, factor, seed, max_jitter_s, mix_window_s)


def _natural(workload: Workload, factor: float, seed: int, max_jitter_s: float, mix_window_s: float) -> Workload:
    reqs = workload.requests
    times = [r.arrival_s for r in reqs]
    # Two streams: which requests exist and when (arrivals), and which lengths they carry (mix), so a change
    # of the mix window never moves an arrival.
    arrivals = random.Random(f"natural-arrivals-{seed}")
    mix = random.Random(f"natural-mix-{seed}")
    stride = max(r.index for r in reqs) + 1
    id_range = max((h for r in reqs for h in r.hash_ids), default=-1) + 1
    extra = factor - 1.0
    out: list[TraceRequest] = []
    half = mix_window_s / 2.0
    for i, r in enumerate(reqs):
        if factor < 1.0:
            if arrivals.random() < factor:
                out.append(r)
            continue
        out.append(r)
        copies = int(extra) + (1 if arrivals.random() < extra - int(extra) else 0)
        if copies == 0:
            continue
        left = (times[i] - times[i - 1]) / 2.0 if i > 0 else None
        right = (times[i + 1] - times[i]) / 2.0 if i + 1 < len(reqs) else None
        left = min(max_jitter_s, left if left is not None else (right or 0.0))
        right = min(max_jitter_s, right if right is not None else left)
        lo_i = bisect.bisect_left(times, times[i] - half)
        hi_i = bisect.bisect_right(times, times[i] + half)
        for j in range(1, copies + 1):
            t = max(0.0, times[i] - left + arrivals.random() * (left + right))
            source = reqs[mix.randrange(lo_i, hi_i)]
            out.append(msgspec.structs.replace(
                r, index=r.index + j * stride, arrival_s=t, input_tokens=source.input_tokens,
                output_tokens=source.output_tokens, hash_ids=tuple(h + j * id_range for h in source.hash_ids)))
    out.sort(key=lambda q: (q.arrival_s, q.index))
    return Workload(name=workload.name, requests=out)
