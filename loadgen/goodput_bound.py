"""An upper bound on the goodput any policy can reach on a workload: what its requests' work costs on the
latency model, against what the GPUs can do in the time the SLOs leave.

A benchmark shows how far Poise is above the fixed splits and colocated serving; this says how far it could
still be from the ceiling, whatever the controller, the dispatcher or the engines' scheduling. The bound
relaxes everything a real cluster must respect except the work itself and the deadlines:

- **Work.** On the latency model (``shared.latency``) a request of ``I`` prompt tokens and ``O`` output
  tokens costs at least its prompt's compute, ``prefill_work_s(I)`` (a pass's launch overhead can be shared,
  and a colocated engine's mixed step pays none for its chunks), plus one decode-step share per later token:
  ``s + c * (I + j)`` for the ``j``-th (the per-sequence term and the read of its context) and a share of the
  step's overhead ``o``. A step runs at most ``B = max_running_requests`` sequences whose contexts fit the
  KV pool of ``K`` tokens, so charging each token ``o / B``, or ``o * (I + j) / K``, never charges a step more
  than ``o``; the bound takes whichever forces more misses (the second where contexts are long and KV, not
  the running cap, limits the batch: Mooncake). However the cluster is split, batched or scheduled, its GPUs
  spend at least this on every request they serve.
- **Deadlines.** A request meets its SLO only if its prompt is done within the TTFT target of its arrival
  (the first token follows the prefill) and its last token within ``TTFT + (O - 1) * TPOT`` (TPOT is the mean
  over its tokens). A prompt whose compute alone exceeds the TTFT target misses on any cluster (one prompt
  runs on one instance).
- **Capacity.** ``instances`` GPUs give ``instances`` GPU-seconds per second. Cut the counted part of the
  run into windows: requests arriving in ``[a, a + w]``, with a horizon ``h = a + w + TTFT + slack``; the
  next window opens at the first arrival at or after ``h``, so no two windows share GPU time. Of the
  requests arriving in a window, those that meet their SLO must have their prompt done by ``h``, and all
  their work where their last-token deadline is before ``h``; all of it runs after ``a`` (they had not
  arrived before). Where that due work exceeds
  ``instances * (h - a)``, at least the fewest requests whose due work covers the excess miss. The windows'
  misses add up; a window of the whole run is the average-load bound. Each cut gives a valid lower bound on
  the misses, so the largest over several window lengths and slacks is one too.

``1 - misses / counted`` bounds the attainment at a rate scale, and the largest scale whose bound reaches the
target, with every lower scale tried, bounds the goodput (the same search and warm-up as the simulator's
goodput, ``loadgen.sim.goodput``). It holds for engines without a prefix cache (a cached prefix costs no
compute). What it leaves out, KV transfers, scheduling gaps, queueing within the TTFT target, the KV pool's
limit on what runs at once, only costs a real cluster more: policies land below it, and how far below is
the bench's subject (``tests/bench/goodput_bound.py``).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import numpy as np

from loadgen.rate_scaling import scale_load
from loadgen.sim.goodput import Yardstick, search_scales
from loadgen.slo import SLO
from loadgen.workload import TraceRequest, Workload
from shared.latency import LatencyModel

#: How a decode step's overhead is shared among its tokens (module doc, "Work").
OverheadShare = Literal["batch", "kv"]

#: Window lengths (s) and slacks past the TTFT target (s) the bound cuts the run with; ``inf`` is one window
#: over the whole counted run. Short windows catch bursts (0: the requests of one instant), long ones
#: sustained overload; slack lets a window's decode work count.
WINDOWS_S: tuple[float, ...] = (0.0, 1.0, 5.0, 15.0, 60.0, 300.0, math.inf)
SLACKS_S: tuple[float, ...] = (0.0, 30.0)


def request_work_s(model: LatencyModel, input_tokens: int, output_tokens: int,
                   overhead_by: OverheadShare = "batch") -> tuple[float, float]:
    """(prompt work, whole work): the GPU-seconds a request costs at least (module doc, "Work"), with each
    later token's share of a decode step's overhead counted by ``overhead_by``."""
    p = model.profile
    prompt = model.prefill_work_s(input_tokens, 0)
    k = max(0, output_tokens - 1)  # the first token comes with the prompt
    context = k * input_tokens + k * (k + 1) / 2  # the context tokens its decode steps read, summed
    if overhead_by == "batch":
        overhead = k * p.decode_overhead_s / p.max_running_requests
    else:
        overhead = context * p.decode_overhead_s / p.kv_capacity_tokens
    decode = k * p.decode_s_per_seq + p.decode_s_per_context_token * context + overhead
    return prompt, prompt + decode * model.time_scale


@dataclass(frozen=True)
class MissBound:
    """What the bound says about one run: how many counted requests must miss, and why."""

    counted: int
    infeasible: int  # prompts whose compute alone exceeds the TTFT target
    over_capacity: int  # the most any one cut of the run into windows forces to miss, besides those
    cut: tuple[float, float]  # that cut's (window, slack) in seconds

    @property
    def misses(self) -> int:
        return self.infeasible + self.over_capacity

    @property
    def attainment(self) -> float:
        """The highest attainment any policy can reach."""
        return 1.0 - self.misses / self.counted if self.counted else 0.0


def miss_bound(requests: Sequence[TraceRequest], model: LatencyModel, slo: SLO, instances: int, *,
               warmup_s: float = 0.0, windows_s: Sequence[float] = WINDOWS_S,
               slacks_s: Sequence[float] = SLACKS_S) -> MissBound:
    """The fewest of ``requests`` arriving at or after ``warmup_s`` that must miss ``slo`` on ``instances``
    GPUs (the module doc)."""
    if instances < 1:
        raise ValueError("instances must be at least 1")
    counted = sorted((r for r in requests if r.arrival_s >= warmup_s), key=lambda r: r.arrival_s)
    if not counted:
        return MissBound(0, 0, 0, (0.0, 0.0))
    arrival = np.array([r.arrival_s for r in counted])
    works = [np.array([request_work_s(model, r.input_tokens, max(1, r.output_tokens), share) for r in counted])
             for share in ("batch", "kv")]
    prompt = works[0][:, 0]
    last_token = arrival + slo.ttft_s + np.array([max(0, r.output_tokens - 1) for r in counted]) * slo.tpot_s
    feasible = prompt <= slo.ttft_s
    best = (0, (0.0, 0.0))
    for w in windows_s:
        for slack in slacks_s:
            if math.isinf(w) and slack > 0:
                continue  # one window over the run: its horizon is the last deadline already
            for work in works:
                misses = _window_misses(arrival, prompt, work[:, 1], last_token, feasible, slo.ttft_s, instances,
                                        w, slack)
                if misses > best[0]:
                    best = (misses, (w, slack))
    return MissBound(len(counted), int(np.count_nonzero(~feasible)), best[0], best[1])


def _window_misses(arrival: np.ndarray, prompt: np.ndarray, whole: np.ndarray, last_token: np.ndarray,
                   feasible: np.ndarray, ttft_s: float, instances: int, w: float, slack: float) -> int:
    """Misses forced by one cut of the run into windows of ``w`` seconds (horizon ``w + ttft_s + slack``),
    each starting at the first arrival past the last one's horizon, so a burst opens its own window."""
    misses = 0
    lo, n = 0, len(arrival)
    while lo < n:
        a = arrival[lo]
        if math.isinf(w):
            hi, h = n, float(last_token.max())
        else:
            hi, h = int(np.searchsorted(arrival, a + w, "right")), a + w + ttft_s + slack
        keep = feasible[lo:hi]
        due = np.where(last_token[lo:hi] <= h, whole[lo:hi], prompt[lo:hi])[keep]
        excess = float(due.sum()) - instances * (h - a)
        if excess > 0:
            covered = np.cumsum(np.sort(due)[::-1])  # the largest first: the fewest requests to give up
            misses += int(np.searchsorted(covered, excess * (1 - 1e-12), "left")) + 1
        lo = max(hi, int(np.searchsorted(arrival, h, "left")))
    return misses


def attainment_bound(workload: Workload, model: LatencyModel, slo: SLO, instances: int, scale: float,
                     yardstick: Yardstick | None = None) -> MissBound:
    """:func:`miss_bound` for ``workload`` at ``scale`` times its rate, raised and counted as the simulator's
    goodput search does on ``yardstick``."""
    y = yardstick or Yardstick()
    scaled = scale_load(workload, scale, y.rate_mode, seed=y.seed)
    return miss_bound(scaled.requests, model, slo, instances, warmup_s=y.warmup_for(workload, scale))


def throughput_bound(workload: Workload, model: LatencyModel, slo: SLO, instances: int,
                     yardstick: Yardstick | None = None) -> float:
    """The rate scale past which ``instances`` GPUs cannot even do the work of every counted request, SLOs
    aside: the GPU-seconds from the first counted arrival to the last one's last-token deadline over the
    work per unit of scale (the work grows with the scale, the span does not). Goodput can lie above it
    only by giving requests up."""
    y = yardstick or Yardstick()
    counted = [r for r in workload.requests if r.arrival_s >= y.warmup_for(workload, 1.0)]
    if not counted:
        return math.inf
    work = max(sum(request_work_s(model, r.input_tokens, max(1, r.output_tokens), share)[1] for r in counted)
               for share in ("batch", "kv"))
    end = max(r.arrival_s + slo.ttft_s + max(0, r.output_tokens - 1) * slo.tpot_s for r in counted)
    return instances * (end - counted[0].arrival_s) / work if work > 0 else math.inf


@dataclass
class GoodputBound:
    goodput_scale: float  # no policy passes the target above this scale (at the search's resolution)
    points: list[tuple[float, MissBound]]  # every scale tried, in order


def goodput_bound(workload: Workload, model: LatencyModel, slo: SLO, instances: int, *, target: float = 0.9,
                  bisections: int = 6, yardstick: Yardstick | None = None) -> GoodputBound:
    """The highest scale at which the attainment bound, and the bound at every lower scale tried, reaches
    ``target``: the simulator's goodput search (:func:`loadgen.sim.goodput.search_scales`) run on the bound.
    A policy's goodput, searched the same way, lies below the first scale this fails."""
    points: list[tuple[float, MissBound]] = []

    def passes(scale: float) -> bool:
        bound = attainment_bound(workload, model, slo, instances, scale, yardstick)
        points.append((scale, bound))
        return bound.attainment >= target

    found = search_scales(passes, bisections=bisections)
    return GoodputBound(found.goodput_scale, sorted(points, key=lambda p: p[0]))
