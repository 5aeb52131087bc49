"""Seeded synthetic workloads: Poisson and bursty arrivals with chosen length laws.

Owns the arrival processes and length distributions used when no trace fits
(smoke tests, controlled sweeps). Every generator is a pure function of its
arguments and ``seed``: the same call returns the same `Workload`, on any
machine, because only `random.Random` (whose streams Python keeps stable) is used.
Arrivals and lengths draw from separate streams, so changing a length
distribution does not move any arrival time.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass
from typing import Protocol

from loadgen.workload import TraceRequest, Workload


class LengthDist(Protocol):
    """A distribution of token counts (positive ints)."""

    def sample(self, rng: random.Random) -> int: ...


def _clamp(value: float, low: int, high: int) -> int:
    return max(low, min(high, round(value)))


@dataclass(frozen=True, slots=True)
class FixedLengths:
    """Every request has exactly ``tokens`` tokens (isolates arrival effects)."""

    tokens: int

    def __post_init__(self) -> None:
        if self.tokens < 1:
            raise ValueError(f"tokens must be >= 1, got {self.tokens}")

    def sample(self, rng: random.Random) -> int:
        return self.tokens


@dataclass(frozen=True, slots=True)
class LogNormalLengths:
    """Log-normal lengths with the given ``median`` and log-space ``sigma``, clamped to [min, max].

    Real prompt/response lengths are roughly log-normal (Azure conv inputs have
    median ~1k with a long right tail); parametrising by the median keeps the
    knob intuitive.
    """

    median: float
    sigma: float
    min: int = 1
    max: int = 32768

    def __post_init__(self) -> None:
        if self.median <= 0 or self.sigma < 0:
            raise ValueError(f"need median > 0 and sigma >= 0, got {self.median}, {self.sigma}")
        if not 1 <= self.min <= self.max:
            raise ValueError(f"need 1 <= min <= max, got min={self.min} max={self.max}")

    def sample(self, rng: random.Random) -> int:
        return _clamp(rng.lognormvariate(math.log(self.median), self.sigma), self.min, self.max)


@dataclass(frozen=True, slots=True)
class ParetoLengths:
    """Pareto (power-law) lengths: ``min * X`` with ``X ~ Pareto(alpha)``, clamped to ``max``.

    Heavier-tailed than log-normal; use it to stress schedulers with rare huge
    prompts. Smaller ``alpha`` = heavier tail (the mean is infinite for alpha <= 1
    before clamping).
    """

    min: int
    alpha: float = 1.5
    max: int = 32768

    def __post_init__(self) -> None:
        if self.alpha <= 0:
            raise ValueError(f"alpha must be > 0, got {self.alpha}")
        if not 1 <= self.min <= self.max:
            raise ValueError(f"need 1 <= min <= max, got min={self.min} max={self.max}")

    def sample(self, rng: random.Random) -> int:
        return _clamp(self.min * rng.paretovariate(self.alpha), self.min, self.max)


def _streams(seed: int) -> tuple[random.Random, random.Random]:
    """Independent arrival and length streams derived from one seed."""
    return random.Random(f"poise-arrivals-{seed}"), random.Random(f"poise-lengths-{seed}")


def _build(
    name: str,
    arrivals: list[float],
    input_dist: LengthDist,
    output_dist: LengthDist,
    lengths_rng: random.Random,
) -> Workload:
    requests = [
        TraceRequest(
            index=i,
            arrival_s=arrival,
            input_tokens=input_dist.sample(lengths_rng),
            output_tokens=output_dist.sample(lengths_rng),
        )
        for i, arrival in enumerate(arrivals)
    ]
    return Workload(name=name, requests=requests)


def _check_rate(rate_rps: float, duration_s: float) -> None:
    if not rate_rps > 0 or not duration_s > 0:
        raise ValueError(f"need rate_rps > 0 and duration_s > 0, got {rate_rps}, {duration_s}")


def poisson(
    rate_rps: float,
    duration_s: float,
    input_dist: LengthDist,
    output_dist: LengthDist,
    seed: int = 0,
    name: str = "synthetic-poisson",
) -> Workload:
    """Poisson arrivals at ``rate_rps`` over ``[0, duration_s)`` (exponential gaps).

    The first request arrives at the first exponential gap, not at 0, so the
    count over the window has the Poisson mean ``rate_rps * duration_s``.
    """
    _check_rate(rate_rps, duration_s)
    arrivals_rng, lengths_rng = _streams(seed)
    arrivals: list[float] = []
    t = arrivals_rng.expovariate(rate_rps)
    while t < duration_s:
        arrivals.append(t)
        t += arrivals_rng.expovariate(rate_rps)
    return _build(name, arrivals, input_dist, output_dist, lengths_rng)


def bursty(
    rate_rps: float,
    duration_s: float,
    input_dist: LengthDist,
    output_dist: LengthDist,
    seed: int = 0,
    *,
    burst_factor: float = 4.0,
    burst_fraction: float = 0.2,
    mean_period_s: float = 20.0,
    name: str = "synthetic-bursty",
) -> Workload:
    """Two-state Markov-modulated Poisson (on/off) arrivals with mean rate ``rate_rps``.

    The process alternates between a *burst* state with rate
    ``burst_factor * rate_rps`` and a *calm* state whose rate is chosen so the
    long-run mean stays ``rate_rps``:
    ``calm = rate_rps * (1 - burst_factor * burst_fraction) / (1 - burst_fraction)``.
    State holding times are exponential; a full burst+calm cycle lasts
    ``mean_period_s`` on average, of which ``burst_fraction`` is bursting.
    ``burst_factor * burst_fraction == 1`` gives a pure on/off source (silent
    calm periods). Defaults: 4x bursts 20% of the time, 20 s cycles, calm at
    0.25x the mean rate. The initial state is drawn from the stationary
    distribution so the start is not biased.
    """
    _check_rate(rate_rps, duration_s)
    if burst_factor < 1:
        raise ValueError(f"burst_factor must be >= 1, got {burst_factor}")
    if not 0 < burst_fraction < 1:
        raise ValueError(f"burst_fraction must be in (0, 1), got {burst_fraction}")
    if burst_factor * burst_fraction > 1 + 1e-12:
        raise ValueError(
            f"burst_factor * burst_fraction must be <= 1 (got {burst_factor} * {burst_fraction}): "
            "bursts would already carry more than the mean rate"
        )
    if not mean_period_s > 0:
        raise ValueError(f"mean_period_s must be > 0, got {mean_period_s}")
    burst_rate = burst_factor * rate_rps
    calm_rate = max(0.0, rate_rps * (1 - burst_factor * burst_fraction) / (1 - burst_fraction))
    mean_hold = {True: burst_fraction * mean_period_s, False: (1 - burst_fraction) * mean_period_s}
    arrivals_rng, lengths_rng = _streams(seed)
    arrivals: list[float] = []
    in_burst = arrivals_rng.random() < burst_fraction
    segment_start = 0.0
    while segment_start < duration_s:
        segment_end = min(duration_s, segment_start + arrivals_rng.expovariate(1 / mean_hold[in_burst]))
        rate = burst_rate if in_burst else calm_rate
        if rate > 0:
            # Exponential gaps are memoryless, so restarting at the boundary is exact.
            t = segment_start + arrivals_rng.expovariate(rate)
            while t < segment_end:
                arrivals.append(t)
                t += arrivals_rng.expovariate(rate)
        segment_start = segment_end
        in_burst = not in_burst
    return _build(name, arrivals, input_dist, output_dist, lengths_rng)
