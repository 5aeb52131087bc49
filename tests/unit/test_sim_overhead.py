"""FirstTokenDelay.fit: a measured live-minus-model delay becomes the simulator's delay."""

from __future__ import annotations

import pytest

from loadgen.metrics import percentile
from loadgen.sim.overhead import LIVE_STACK_DELAY, FirstTokenDelay


def test_fit_reproduces_the_measured_median_and_p90() -> None:
    measured = sorted(LIVE_STACK_DELAY(i) for i in range(3000))
    fitted = FirstTokenDelay.fit(measured)
    assert fitted.median_s == pytest.approx(percentile(measured, 50))
    assert fitted.p90_s == pytest.approx(percentile(measured, 90))
    # ... and draws from the fitted delay have that median and p90 again.
    draws = [fitted(i) for i in range(3000)]
    assert percentile(draws, 50) == pytest.approx(fitted.median_s, rel=0.1)
    assert percentile(draws, 90) == pytest.approx(fitted.p90_s, rel=0.1)


def test_fit_clamps_a_path_faster_than_the_model_to_no_delay() -> None:
    assert FirstTokenDelay.fit([-0.004, -0.002, -0.001]) == FirstTokenDelay(0.0, 0.0)
    mostly_negative = FirstTokenDelay.fit([-0.004, -0.002, -0.001, 0.001, 0.030])
    assert mostly_negative.median_s == 0.0 and mostly_negative.p90_s > 0  # a valid delay, not a ValueError
    assert mostly_negative(7) == 0.0


def test_fit_refuses_no_measurements() -> None:
    with pytest.raises(ValueError):
        FirstTokenDelay.fit([])
