"""The held-out set: three workloads generated once, with fixed seeds, in shapes nothing here was tuned on.

The stress set (`loadgen.stress`) stopped being held out once its results changed the controller (each such
workload is "seen" in tests/bench/sustained.py). These are its successors, and the same rule holds, more
strictly: no change may cite a result on them, no parameter may be fitted to them, and a commit that changes
a policy says which set it was tuned on. They are reported, never used to choose.

Each is the superposition of independent streams ("tenants"), each a non-homogeneous Poisson process around
``BASE_RATE_RPS`` (the Azure 2023 conversation trace's mean rate, so a rate scale means the same load as on
that trace) with length pairs drawn from a real trace:

- ``heldout-batch-waves`` (45 min): chat (Azure conversation pairs) at a steady 0.7x base, and every 15
  minutes from minute 5 a 5-minute wave of batch jobs (Azure code pairs: ~2k-token prompts, short answers)
  at 0.8x base. The best split swings between the chat mix and the prompt-heavy waves, three times.
- ``heldout-multi-tenant`` (40 min): three tenants at once: chat (Azure conversation) at 0.5x; a code
  assistant (Azure code) rising from 0.1x to 0.6x at minute 20 and back; a short-prompt API (Azure
  conversation pairs with at most 256 input tokens) at 0.2x with 60-s bursts to 3x every 7 minutes from
  minute 2.
- ``heldout-week`` (60 min): a week compressed to an hour, seven days of 60/7 minutes, each a cosine from
  night to midday: weekdays from 0.3x to 1.4x, the weekend from 0.2x to 0.7x; a fifth of the requests are
  code (Azure code pairs), the rest chat.

Every stream draws its arrivals and its lengths from two ``random.Random`` streams seeded with strings, so
the workloads are rebuilt identically on every call and machine. `loadgen.traces.load_trace` accepts the
names; `loadgen.slo.slo_for` judges them by the Azure conversation SLO, as the stress set.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

from loadgen.stress import (
    BASE_RATE_RPS,
    MINUTE_S,
    Pair,
    TracesDir,
    build_workload,
    code_pairs,
    conv_pairs,
    poisson_times,
    rng_stream,
)
from loadgen.workload import Workload

#: The short-prompt API tenant keeps the Azure conversation pairs with at most this many input tokens.
API_PROMPT_MAX_TOKENS = 256

Pool = Callable[[TracesDir], tuple[Pair, ...]]


def _api_pairs(traces_dir: TracesDir) -> tuple[Pair, ...]:
    return tuple(p for p in conv_pairs(traces_dir) if p[0] <= API_PROMPT_MAX_TOKENS)


@dataclass(frozen=True)
class Stream:
    """One tenant: ``BASE_RATE_RPS * multiplier(t)`` requests/s, length pairs from ``pool``."""

    name: str
    multiplier: Callable[[float], float]
    peak: float  # an upper bound of ``multiplier`` (thinning draws candidates at it)
    pool: Pool


@dataclass(frozen=True)
class HeldOutShape:
    seed: int
    duration_s: float
    streams: tuple[Stream, ...]

    def multiplier(self, t_s: float) -> float:
        """The whole workload's rate, in multiples of the base rate."""
        return sum(s.multiplier(t_s) for s in self.streams)


def _waves(base: float, wave: float, every_s: float, length_s: float, first_at_s: float) -> Callable[[float], float]:
    def multiplier(t_s: float) -> float:
        on = t_s >= first_at_s and (t_s - first_at_s) % every_s < length_s
        return wave if on else base
    return multiplier


def _triangle(low: float, high: float, apex_s: float, duration_s: float) -> Callable[[float], float]:
    def multiplier(t_s: float) -> float:
        rise = t_s / apex_s if t_s < apex_s else (duration_s - t_s) / (duration_s - apex_s)
        return low + (high - low) * max(0.0, min(1.0, rise))
    return multiplier


def _week(share: float) -> Callable[[float], float]:
    """Seven cosine days in an hour, ``share`` of the rate: weekdays 0.3x-1.4x, weekend 0.2x-0.7x."""
    day_s = 60 * MINUTE_S / 7

    def multiplier(t_s: float) -> float:
        day = min(6, int(t_s // day_s))
        low, high = (0.2, 0.7) if day >= 5 else (0.3, 1.4)
        phase = (t_s - day * day_s) / day_s  # 0 at midnight, 0.5 at midday
        return share * (low + (high - low) * (1 - math.cos(2 * math.pi * phase)) / 2)
    return multiplier


BATCH_WAVES = HeldOutShape(seed=9_201, duration_s=45 * MINUTE_S, streams=(
    Stream("chat", lambda t: 0.7, 0.7, conv_pairs),
    Stream("batch", _waves(0.0, 0.8, 15 * MINUTE_S, 5 * MINUTE_S, 5 * MINUTE_S), 0.8, code_pairs),
))
MULTI_TENANT = HeldOutShape(seed=9_202, duration_s=40 * MINUTE_S, streams=(
    Stream("chat", lambda t: 0.5, 0.5, conv_pairs),
    Stream("code", _triangle(0.1, 0.6, 20 * MINUTE_S, 40 * MINUTE_S), 0.6, code_pairs),
    Stream("api", _waves(0.2, 3.0, 7 * MINUTE_S, 60.0, 2 * MINUTE_S), 3.0, _api_pairs),
))
WEEK = HeldOutShape(seed=9_203, duration_s=60 * MINUTE_S, streams=(
    Stream("chat", _week(0.8), 0.8 * 1.4, conv_pairs),
    Stream("code", _week(0.2), 0.2 * 1.4, code_pairs),
))

#: The held-out set's shapes, by workload name.
HELD_OUT_SHAPES: dict[str, HeldOutShape] = {
    "heldout-batch-waves": BATCH_WAVES,
    "heldout-multi-tenant": MULTI_TENANT,
    "heldout-week": WEEK,
}


def _stream_requests(name: str, shape: HeldOutShape, stream: Stream, traces_dir: TracesDir) -> list[tuple[float, Pair]]:
    """One tenant's arrivals (thinned from its peak rate) with their length pairs."""
    arrivals = rng_stream(name, f"{stream.name}/arrivals", shape.seed)
    candidates = poisson_times(BASE_RATE_RPS * stream.peak, shape.duration_s, arrivals)
    times = [t for t in candidates if arrivals.random() * stream.peak < stream.multiplier(t)]
    lengths = rng_stream(name, f"{stream.name}/lengths", shape.seed)
    pool = stream.pool(traces_dir)
    return [(t, lengths.choice(pool)) for t in times]


def load_held_out(name: str, traces_dir: TracesDir = None) -> Workload:
    """The held-out workload called ``name``, or a ValueError listing the known names."""
    shape = HELD_OUT_SHAPES.get(name)
    if shape is None:
        raise ValueError(f"unknown held-out workload {name!r}; known: {', '.join(HELD_OUT_SHAPES)}")
    merged = sorted((r for s in shape.streams for r in _stream_requests(name, shape, s, traces_dir)),
                    key=lambda r: r[0])
    return build_workload(name, [t for t, _ in merged], [p for _, p in merged])
