"""Continuous re-prediction: the predictor runs every k decode iterations, estimates count down in between."""

from __future__ import annotations

import numpy as np
import pytest

from services.predictor.online import ContinuousPredictor


class FakePredictor:
    """Predicts ``value`` for every row; records the batch size of each call."""

    def __init__(self, value: float = 100.0) -> None:
        self.value = value
        self.calls: list[int] = []

    def __call__(self, hidden: np.ndarray) -> np.ndarray:
        self.calls.append(hidden.shape[0])
        return np.full(hidden.shape[0], self.value)


def test_predicts_every_k_iterations_and_counts_down_in_between() -> None:
    fake = FakePredictor(100.0)
    cp = ContinuousPredictor(fake, k=5)
    cp.admit("a", max_new_tokens=1000, hidden=np.zeros(4))  # prefill-time estimate
    assert fake.calls == [1] and cp.remaining("a") == 100.0
    asked = []

    def hidden() -> np.ndarray:
        asked.append(True)
        return np.zeros((1, 4))

    predicted = [cp.step(["a"], [g], hidden) for g in range(1, 11)]
    assert predicted == [False, False, False, False, True, False, False, False, False, True]
    assert len(asked) == 2  # the hidden states are materialised only on the predicting iterations
    assert fake.calls == [1, 1, 1]
    fake.value = 50.0
    for g in range(11, 15):
        cp.step(["a"], [g], hidden)
        assert cp.remaining("a") == 100.0 - (g - 10)  # counted down from the prediction made at g = 10
    cp.step(["a"], [15], hidden)  # the 15th iteration: predicts again
    assert cp.remaining("a") == 50.0
    assert cp.calls == 4 and cp.rows == 4


def test_the_whole_batch_is_predicted_in_one_call() -> None:
    fake = FakePredictor()
    cp = ContinuousPredictor(fake, k=2)
    for rid in "abc":
        cp.admit(rid, 500, hidden=np.zeros(3))
    fake.calls.clear()
    cp.step(list("abc"), [1, 1, 1], np.zeros((3, 3)))
    cp.step(list("abc"), [2, 2, 2], np.zeros((3, 3)))
    assert fake.calls == [3]


def test_estimates_are_clamped_to_the_cap_and_to_at_least_one() -> None:
    cp = ContinuousPredictor(FakePredictor(100.0), k=20)
    cp.admit("a", max_new_tokens=60, generated=0, hidden=np.zeros(2))
    assert cp.remaining("a") == 60.0  # max_new_tokens - generated bounds the prediction
    cp.step(["a"], [30], np.zeros((1, 2)))
    assert cp.remaining("a") == 30.0
    cp.admit("b", max_new_tokens=1000, hidden=np.zeros(2))
    assert cp.remaining("b", generated=150) == 1.0  # outlived its prediction: still running, so >= 1
    assert cp.remaining("a", generated=60) == 0.0  # at the cap nothing is left
    assert cp.estimates() == {"a": 30.0, "b": 100.0}


def test_negative_predictions_are_floored() -> None:
    cp = ContinuousPredictor(lambda h: np.full(h.shape[0], -40.0), k=1)
    cp.admit("a", 100, hidden=np.zeros(2))
    assert cp.remaining("a") == 1.0


def test_a_request_without_an_estimate_is_predicted_at_its_first_iteration() -> None:
    fake = FakePredictor(70.0)
    cp = ContinuousPredictor(fake, k=20)
    cp.admit("old", 500, hidden=np.zeros(2))
    cp.admit("new", 500)
    assert cp.remaining("new") == 500.0  # max_new_tokens - generated until predicted
    fake.calls.clear()
    assert cp.step(["old", "new"], [3, 0], np.zeros((2, 2))) is True
    assert fake.calls == [1]  # off the cycle, and only the new row
    assert cp.remaining("new") == 70.0
    cp.release("new")
    assert "new" not in cp and "old" in cp
    assert cp.step(["new"], [1], np.zeros((1, 2)))  # an unknown rid is tracked from its first iteration
    assert cp.remaining("new") == 70.0


def test_bad_inputs_are_rejected() -> None:
    with pytest.raises(ValueError):
        ContinuousPredictor(FakePredictor(), k=0)
    cp = ContinuousPredictor(FakePredictor(), k=1)
    with pytest.raises(ValueError):
        cp.step(["a", "b"], [1], np.zeros((2, 2)))
    with pytest.raises(ValueError):
        cp.step(["a", "b"], [1, 1], np.zeros((3, 2)))
    bad = ContinuousPredictor(lambda h: np.zeros(h.shape[0] + 1), k=1)
    with pytest.raises(ValueError):
        bad.admit("a", 10, hidden=np.zeros(2))


def test_a_prefill_batch_is_admitted_with_one_call() -> None:
    fake = FakePredictor(40.0)
    cp = ContinuousPredictor(fake, k=5)
    cp.admit_batch(["a", "b", "c"], [100, 100, 10], np.zeros((3, 4)))
    assert fake.calls == [3]
    assert cp.remaining("a") == 40.0 and cp.remaining("c") == 10.0  # clamped to the cap
    assert cp.predicted_at("a") == 0
    cp.admit("d", 100)
    assert cp.predicted_at("d") is None
    with pytest.raises(ValueError, match="differ in length"):
        cp.admit_batch(["x"], [1, 2], np.zeros((1, 4)))
