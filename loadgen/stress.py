"""The stress set: held-out workloads whose load moves in known ways, to evaluate the prefill:decode controller.

The adaptive prefill:decode controller is tuned on the public traces; these workloads are kept apart to judge
it on load it has not seen. No controller parameter may be tuned on them: once a result on the stress set
feeds back into a parameter, the set no longer measures how the controller generalises.

Every workload runs at natural time (seconds) around ``BASE_RATE_RPS``, the Azure 2023 conversation trace's
own mean rate, so a benchmark's rate scale (`loadgen.rate_scaling`, applied on top) means the same load here
as on that trace. Arrivals are a non-homogeneous Poisson process following a rate curve; each request carries
an (input, output) length pair drawn from a real trace:

- ``stress-step``: 0.5x base for 10 minutes, then a step to 1.5x held for 20. Tests how fast the controller
  follows a sudden, lasting change and whether it settles instead of oscillating.
- ``stress-ramp``: a linear ramp from 0.25x to 1.75x over 30 minutes. Tests tracking of a slow drift, where
  each control period sees only a small change.
- ``stress-bursts``: base rate with a 30-s burst at 10x every 5 minutes (the first at minute 3). Tests that
  the controller rides out short bursts rather than reshuffling instances for them.
- ``stress-mix-shift``: a constant request rate whose length mix moves from short prompts (Azure conversation
  pairs with at most 1024 input tokens) through a 10-minute linear blend to Azure code pairs (~2k-token
  prompts, short outputs). The prefill work per second grows about 4x while decode work shrinks, so the best
  prefill:decode split moves although the request rate does not.
- ``stress-diurnal``: one cosine day over 40 minutes, from 0.3x base up to 1.5x and back, over Azure
  conversation pairs. Tests scaling up and back down on a smooth curve.

Each workload has a fixed seed and is rebuilt identically on every call and machine: arrivals and lengths come
from two separate ``random.Random`` streams seeded with strings (hashed the same on every platform), so a change
of the length pools never moves an arrival. `loadgen.traces.load_trace` accepts the names too, and
`loadgen.slo.slo_for` judges all of them by the Azure conversation SLO.
"""

from __future__ import annotations

import functools
import os
import random
from dataclasses import dataclass
from math import pi, sin
from pathlib import Path
from typing import Protocol, TypeAlias

from loadgen.dayshape import day_shape, rate_multiplier
from loadgen.traces import default_traces_dir, load_trace
from loadgen.workload import TraceRequest, Workload

MINUTE_S = 60.0

#: The Azure 2023 conversation trace's mean rate (19,366 requests over 3,502 s, as `Workload.mean_rate_rps`
#: reports it): every multiplier below scales this.
BASE_RATE_RPS = 19_366 / 3_502

#: Mix-shift's short phase keeps the Azure conversation pairs with at most this many input tokens.
SHORT_PROMPT_MAX_TOKENS = 1024

#: Arrival times are rounded to the microsecond so reports and digests of a workload carry no float noise.
_ARRIVAL_DIGITS = 6

Pair: TypeAlias = tuple[int, int]
TracesDir: TypeAlias = str | os.PathLike[str] | None


class RateShape(Protocol):
    """A workload's rate curve: ``BASE_RATE_RPS * multiplier(t)`` requests/s for ``0 <= t < duration_s``."""

    @property
    def seed(self) -> int: ...

    @property
    def duration_s(self) -> float: ...

    @property
    def peak(self) -> float: ...

    def multiplier(self, t_s: float) -> float: ...


@dataclass(frozen=True)
class StepShape:
    """``before`` x base until ``step_at_s``, then ``after`` x base to the end."""

    seed: int
    duration_s: float
    step_at_s: float
    before: float
    after: float

    @property
    def peak(self) -> float:
        return max(self.before, self.after)

    def multiplier(self, t_s: float) -> float:
        return self.before if t_s < self.step_at_s else self.after


@dataclass(frozen=True)
class RampShape:
    """A straight line from ``start`` x base at 0 to ``end`` x base at ``duration_s``."""

    seed: int
    duration_s: float
    start: float
    end: float

    @property
    def peak(self) -> float:
        return max(self.start, self.end)

    def multiplier(self, t_s: float) -> float:
        return self.start + (self.end - self.start) * t_s / self.duration_s


@dataclass(frozen=True)
class BurstShape:
    """Base rate, raised to ``burst`` x base for ``burst_s`` seconds every ``every_s`` from ``first_at_s`` on."""

    seed: int
    duration_s: float
    burst: float
    burst_s: float
    every_s: float
    first_at_s: float

    @property
    def peak(self) -> float:
        return max(1.0, self.burst)

    def windows(self) -> list[tuple[float, float]]:
        """The bursts as ``(start_s, end_s)``, the last one cut at ``duration_s``."""
        out: list[tuple[float, float]] = []
        start = self.first_at_s
        while start < self.duration_s:
            out.append((start, min(start + self.burst_s, self.duration_s)))
            start += self.every_s
        return out

    def multiplier(self, t_s: float) -> float:
        in_burst = t_s >= self.first_at_s and (t_s - self.first_at_s) % self.every_s < self.burst_s
        return self.burst if in_burst else 1.0


@dataclass(frozen=True)
class MixShiftShape:
    """A constant ``rate`` x base; the share of long (code) prompts rises linearly from 0 at ``blend_start_s``
    to 1 at ``blend_end_s``."""

    seed: int
    duration_s: float
    rate: float
    blend_start_s: float
    blend_end_s: float

    @property
    def peak(self) -> float:
        return self.rate

    def multiplier(self, t_s: float) -> float:
        return self.rate

    def long_share(self, t_s: float) -> float:
        fraction = (t_s - self.blend_start_s) / (self.blend_end_s - self.blend_start_s)
        return min(1.0, max(0.0, fraction))


@dataclass(frozen=True)
class DiurnalShape:
    """`loadgen.dayshape.rate_multiplier`: ``low`` x base at 0, ``high`` x base at ``period_s / 2``."""

    seed: int
    duration_s: float
    period_s: float
    low: float
    high: float

    @property
    def peak(self) -> float:
        return self.high

    def multiplier(self, t_s: float) -> float:
        return rate_multiplier(t_s, self.period_s, self.low, self.high)

    def cumulative(self, t_s: float) -> float:
        """The integral of `multiplier` from 0 to ``t_s``: the base-rate seconds that fit before ``t_s``."""
        swing = t_s / 2.0 - self.period_s / (4.0 * pi) * sin(2.0 * pi * t_s / self.period_s)
        return self.low * t_s + (self.high - self.low) * swing


STEP = StepShape(seed=9_101, duration_s=30 * MINUTE_S, step_at_s=10 * MINUTE_S, before=0.5, after=1.5)
RAMP = RampShape(seed=9_102, duration_s=30 * MINUTE_S, start=0.25, end=1.75)
BURSTS = BurstShape(seed=9_103, duration_s=30 * MINUTE_S, burst=10.0, burst_s=30.0, every_s=5 * MINUTE_S,
                    first_at_s=3 * MINUTE_S)
MIX_SHIFT = MixShiftShape(seed=9_104, duration_s=30 * MINUTE_S, rate=1.0, blend_start_s=10 * MINUTE_S,
                          blend_end_s=20 * MINUTE_S)
DIURNAL = DiurnalShape(seed=9_105, duration_s=40 * MINUTE_S, period_s=40 * MINUTE_S, low=0.3, high=1.5)

#: Each stress workload's rate curve, by workload name.
STRESS_SHAPES: dict[str, RateShape] = {
    "stress-step": STEP,
    "stress-ramp": RAMP,
    "stress-bursts": BURSTS,
    "stress-mix-shift": MIX_SHIFT,
    "stress-diurnal": DIURNAL,
}


# --- Length pools ----------------------------------------------------------------------------------------------


@functools.cache
def _pairs(trace: str, directory: str) -> tuple[Pair, ...]:
    return tuple((r.input_tokens, r.output_tokens) for r in load_trace(trace, directory))


def _directory(traces_dir: TracesDir) -> str:
    return os.fspath(Path(traces_dir) if traces_dir is not None else default_traces_dir())


def conv_pairs(traces_dir: TracesDir) -> tuple[Pair, ...]:
    return _pairs("azure-conv", _directory(traces_dir))


def short_conv_pairs(traces_dir: TracesDir) -> tuple[Pair, ...]:
    return tuple(p for p in conv_pairs(traces_dir) if p[0] <= SHORT_PROMPT_MAX_TOKENS)


def code_pairs(traces_dir: TracesDir) -> tuple[Pair, ...]:
    return _pairs("azure-code", _directory(traces_dir))


# --- Arrivals --------------------------------------------------------------------------------------------------


def rng_stream(name: str, stream: str, seed: int) -> random.Random:
    return random.Random(f"{name}/{stream}/{seed}")


def poisson_times(rate_rps: float, horizon_s: float, rng: random.Random) -> list[float]:
    """A homogeneous Poisson process at ``rate_rps`` on ``[0, horizon_s)``."""
    times: list[float] = []
    t = rng.expovariate(rate_rps)
    while t < horizon_s:
        times.append(t)
        t += rng.expovariate(rate_rps)
    return times


def _thinned(shape: RateShape, rng: random.Random) -> list[float]:
    """Arrivals at ``BASE_RATE_RPS * shape.multiplier(t)`` by thinning (Lewis and Shedler): candidates at the
    peak rate, each kept with probability ``multiplier / peak``. Exact for any curve, steps and bursts included."""
    candidates = poisson_times(BASE_RATE_RPS * shape.peak, shape.duration_s, rng)
    return [t for t in candidates if rng.random() * shape.peak < shape.multiplier(t)]


def build_workload(name: str, times: list[float], pairs: list[Pair]) -> Workload:
    requests = [TraceRequest(index=i, arrival_s=round(t, _ARRIVAL_DIGITS), input_tokens=inp, output_tokens=out)
                for i, (t, (inp, out)) in enumerate(zip(times, pairs, strict=True))]
    return Workload(name=name, requests=requests)


# --- The workloads ---------------------------------------------------------------------------------------------


def _shaped(name: str, shape: RateShape, pool: tuple[Pair, ...]) -> Workload:
    times = _thinned(shape, rng_stream(name, "arrivals", shape.seed))
    lengths = rng_stream(name, "lengths", shape.seed)
    return build_workload(name, times, [lengths.choice(pool) for _ in times])


def stress_step(traces_dir: TracesDir = None) -> Workload:
    return _shaped("stress-step", STEP, conv_pairs(traces_dir))


def stress_ramp(traces_dir: TracesDir = None) -> Workload:
    return _shaped("stress-ramp", RAMP, conv_pairs(traces_dir))


def stress_bursts(traces_dir: TracesDir = None) -> Workload:
    return _shaped("stress-bursts", BURSTS, conv_pairs(traces_dir))


def stress_mix_shift(traces_dir: TracesDir = None) -> Workload:
    name, shape = "stress-mix-shift", MIX_SHIFT
    short, long = short_conv_pairs(traces_dir), code_pairs(traces_dir)
    times = _thinned(shape, rng_stream(name, "arrivals", shape.seed))
    lengths = rng_stream(name, "lengths", shape.seed)
    pairs = [lengths.choice(long if lengths.random() < shape.long_share(t) else short) for t in times]
    return build_workload(name, times, pairs)


def stress_diurnal(traces_dir: TracesDir = None) -> Workload:
    """A base-rate Poisson stream as long as the day's cumulative rate, warped onto the day curve by
    `day_shape` (which is the inverse-cumulative-rate method for this curve)."""
    name, shape = "stress-diurnal", DIURNAL
    times = poisson_times(BASE_RATE_RPS, shape.cumulative(shape.duration_s), rng_stream(name, "arrivals", shape.seed))
    lengths = rng_stream(name, "lengths", shape.seed)
    pool = conv_pairs(traces_dir)
    flat = build_workload(name, times, [lengths.choice(pool) for _ in times])
    warped = day_shape(flat, shape.period_s, low=shape.low, high=shape.high)
    return build_workload(name, [r.arrival_s for r in warped], [(r.input_tokens, r.output_tokens) for r in warped])


class StressBuilder(Protocol):
    """Builds one stress workload; called with no argument it reads the traces from `default_traces_dir`."""

    def __call__(self, traces_dir: TracesDir = None) -> Workload: ...


#: The stress set, by workload name.
STRESS_WORKLOADS: dict[str, StressBuilder] = {
    "stress-step": stress_step,
    "stress-ramp": stress_ramp,
    "stress-bursts": stress_bursts,
    "stress-mix-shift": stress_mix_shift,
    "stress-diurnal": stress_diurnal,
}


def load_stress(name: str, traces_dir: TracesDir = None) -> Workload:
    """The stress workload called ``name``, or a ValueError listing the known names."""
    try:
        builder = STRESS_WORKLOADS[name]
    except KeyError:
        raise ValueError(f"unknown stress workload {name!r}; known: {', '.join(STRESS_WORKLOADS)}") from None
    return builder(traces_dir)
