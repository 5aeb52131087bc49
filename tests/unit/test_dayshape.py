"""The day-shaped time warp: same requests, a rate that rises and falls as asked."""

from __future__ import annotations

import pytest

from loadgen.dayshape import day_shape, rate_multiplier, repeat
from loadgen.workload import TraceRequest, Workload


def steady(n: int, rate: float) -> Workload:
    return Workload(name="azure-conv", requests=[TraceRequest(index=i, arrival_s=i / rate, input_tokens=100 + i,
                                                              output_tokens=10) for i in range(n)])


def test_the_rate_follows_the_day_curve() -> None:
    w = steady(20_000, 10.0)
    period = 2000.0 / 0.6  # one whole day over the trace (the mean multiplier of low 0.2, high 1.0 is 0.6)
    d = day_shape(w, period, low=0.2, high=1.0)
    assert len(d) == len(w) and [r.index for r in d] == [r.index for r in w]
    assert [r.input_tokens for r in d] == [r.input_tokens for r in w]
    times = [r.arrival_s for r in d]
    assert times == sorted(times)

    def rate_near(t: float, width: float = 60.0) -> float:
        return sum(1 for x in times if t - width / 2 <= x < t + width / 2) / width

    assert rate_near(period / 2) == pytest.approx(10.0 * rate_multiplier(period / 2, period, 0.2, 1.0), rel=0.1)
    assert rate_near(60.0) == pytest.approx(10.0 * rate_multiplier(60.0, period, 0.2, 1.0), rel=0.15)
    assert rate_near(period / 2) > 4 * rate_near(60.0)


def test_repeat_and_bad_input() -> None:
    w = steady(10, 1.0)
    r = repeat(w, 3)
    assert len(r) == 30 and len({q.index for q in r}) == 30
    assert r.requests[10].arrival_s > r.requests[9].arrival_s
    with pytest.raises(ValueError):
        day_shape(w, 100.0, low=0.0)
    with pytest.raises(ValueError):
        repeat(w, 0)
