"""The online run's scoring: every recorded (request, tokens generated) point against the request's true
remaining length, for the served estimates and the baselines alike."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("torch")

from services.predictor.decode import Generated  # noqa: E402
from services.predictor.live import ONLINE, evaluate  # noqa: E402
from services.predictor.prompts import Prompt  # noqa: E402


def record(tokens: int, estimates: list[tuple[int, float, bool]]) -> Generated:
    return Generated(prompt=Prompt("p", "t", "x"), tokens=list(range(tokens)), estimates=estimates)


def test_errors_are_taken_against_what_was_still_to_come() -> None:
    # 4 tokens: the truth after g generated is 4 - g.
    a = record(4, [(0, 4.0, True), (1, 1.0, False), (2, 2.0, False), (3, 5.0, True)])
    b = record(2, [(0, 1.0, True), (1, 1.0, False)])
    result = evaluate([a, b], {"zero": lambda g: np.zeros(len(g))})
    # online errors: a 0, 2, 0, 4; b 1, 0
    assert result["points"] == 6 and result["predicted_points"] == 3
    assert result["mae"][ONLINE] == pytest.approx(7 / 6)
    assert result["mae_where_predicted"][ONLINE] == pytest.approx(5 / 3)  # 0, 4 and 1
    assert result["mae"]["zero"] == pytest.approx((4 + 3 + 2 + 1 + 2 + 1) / 6)
    assert result["by_bucket"][ONLINE][0] == ("0", pytest.approx(0.5), 2)  # g = 0: errors 0 and 1
