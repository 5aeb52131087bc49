"""Synthetic workload generators: determinism by seed, rates and length laws, SLO table."""

from __future__ import annotations

import statistics

import pytest

from loadgen.slo import SLO, TRACE_SLOS, slo_for
from loadgen.synthetic import FixedLengths, LogNormalLengths, ParetoLengths, bursty, poisson


def test_poisson_is_deterministic_by_seed() -> None:
    args = (20.0, 30.0, LogNormalLengths(500, 0.8, max=4000), FixedLengths(64))
    a = poisson(*args, seed=7)
    assert a == poisson(*args, seed=7)
    assert a != poisson(*args, seed=8)
    assert a.name == "synthetic-poisson"
    assert [r.index for r in a] == list(range(len(a)))
    assert all(0 <= r.arrival_s < 30.0 for r in a)
    assert all(r.output_tokens == 64 for r in a)
    assert all(1 <= r.input_tokens <= 4000 for r in a)


def test_poisson_rate_and_lognormal_median() -> None:
    w = poisson(50.0, 200.0, LogNormalLengths(800, 0.6), FixedLengths(1), seed=1)
    assert len(w) == pytest.approx(10000, rel=0.05)
    gaps = [b.arrival_s - a.arrival_s for a, b in zip(w.requests, w.requests[1:], strict=False)]
    cv = statistics.pstdev(gaps) / statistics.mean(gaps)
    assert cv == pytest.approx(1.0, abs=0.05)  # exponential gaps
    assert statistics.median(r.input_tokens for r in w) == pytest.approx(800, rel=0.05)


def test_arrivals_do_not_depend_on_length_distribution() -> None:
    a = poisson(5.0, 20.0, FixedLengths(10), FixedLengths(10), seed=3)
    b = poisson(5.0, 20.0, ParetoLengths(100), LogNormalLengths(50, 1.0), seed=3)
    assert [r.arrival_s for r in a] == [r.arrival_s for r in b]


def test_bursty_keeps_mean_rate_and_is_burstier() -> None:
    dists = (FixedLengths(100), FixedLengths(10))
    w = bursty(10.0, 2000.0, *dists, seed=5, burst_factor=4.0, burst_fraction=0.2, mean_period_s=20.0)
    assert w == bursty(10.0, 2000.0, *dists, seed=5, burst_factor=4.0, burst_fraction=0.2, mean_period_s=20.0)
    assert len(w) / 2000.0 == pytest.approx(10.0, rel=0.15)
    per_second = [0] * 2000
    for r in w:
        per_second[int(r.arrival_s)] += 1
    p = poisson(10.0, 2000.0, *dists, seed=5)
    per_second_p = [0] * 2000
    for r in p:
        per_second_p[int(r.arrival_s)] += 1
    # Index of dispersion: ~1 for Poisson, much larger for the modulated process.
    assert statistics.pvariance(per_second) / statistics.mean(per_second) > 3
    assert statistics.pvariance(per_second_p) / statistics.mean(per_second_p) < 1.3


def test_bursty_on_off_and_validation() -> None:
    w = bursty(5.0, 100.0, FixedLengths(1), FixedLengths(1), seed=0, burst_factor=5.0, burst_fraction=0.2)
    assert len(w) > 0
    with pytest.raises(ValueError, match="burst_factor \\* burst_fraction"):
        bursty(5.0, 100.0, FixedLengths(1), FixedLengths(1), burst_factor=6.0, burst_fraction=0.2)
    with pytest.raises(ValueError):
        poisson(0.0, 10.0, FixedLengths(1), FixedLengths(1))


def test_length_distributions() -> None:
    import random

    rng = random.Random(0)
    pareto = ParetoLengths(100, alpha=1.2, max=50000)
    samples = [pareto.sample(rng) for _ in range(5000)]
    assert min(samples) >= 100 and max(samples) <= 50000
    assert max(samples) > 20 * statistics.median(samples)  # long tail
    lognormal = LogNormalLengths(1000, 2.0, min=10, max=2000)
    assert all(10 <= lognormal.sample(rng) <= 2000 for _ in range(1000))
    assert FixedLengths(7).sample(rng) == 7
    with pytest.raises(ValueError):
        FixedLengths(0)
    with pytest.raises(ValueError):
        LogNormalLengths(100, 1.0, min=50, max=10)


def test_slo_table() -> None:
    assert slo_for("azure-code") == SLO(3.0, 0.1)
    assert slo_for("azure-conv") == SLO(2.0, 0.15)
    assert slo_for("burstgpt") == SLO(0.25, 0.075)
    assert slo_for("mooncake-conv") == SLO(30.0, 0.1)
    assert slo_for("mooncake-synthetic") == TRACE_SLOS["mooncake-conv"]
    with pytest.raises(ValueError, match="azure-conv") as info:
        slo_for("nope")
    assert "nope" in str(info.value)
    with pytest.raises(ValueError):
        SLO(0.0, 1.0)
