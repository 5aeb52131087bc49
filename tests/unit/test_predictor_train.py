"""Training the length MLP on small synthetic data: it learns, the split never leaks, the report is written."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from services.predictor.data import LengthData, split_by_request  # noqa: E402
from services.predictor.model import load_checkpoint, save_checkpoint  # noqa: E402
from services.predictor.report import write_report  # noqa: E402
from services.predictor.train import (  # noqa: E402
    ARES,
    MEAN,
    METHODS,
    PROMPT_ONLY,
    FitConfig,
    clamp_as_served,
    fit,
    mean_by_position,
    train,
)

D, K, CAP = 16, 20, 400


def synthetic(requests: int = 240, seed: int = 0) -> LengthData:
    """Requests whose hidden state encodes the remaining length (plus noise), like a model that "knows" how
    far it is from done; prompts name a task that only loosely sets the length."""
    rng = np.random.default_rng(seed)
    mix = rng.normal(size=(3, D))
    hidden, rid, position, remaining, tasks, prompts, lengths = [], [], [], [], [], [], []
    for r in range(requests):
        task = ["short", "medium", "long"][r % 3]
        length = int(np.clip(rng.normal({"short": 40, "medium": 150, "long": 300}[task], 60), 5, CAP))
        for g in range(0, length, K):
            left = length - g
            z = np.array([np.log1p(left), left / 100.0, rng.normal()])
            hidden.append(z @ mix + 0.05 * rng.normal(size=D))
            rid.append(r)
            position.append(g)
            remaining.append(left)
        tasks.append(task)
        prompts.append(f"Write a {task} answer about topic {r % 7}.")
        lengths.append(length)
    return LengthData(hidden=np.array(hidden, dtype=np.float32), rid=np.array(rid), position=np.array(position),
                      remaining=np.array(remaining), tasks=tasks, prompts=prompts, output_len=np.array(lengths),
                      hit_cap=np.array(lengths) >= CAP, meta={"model": "Synthetic/Toy", "k": K,
                                                              "max_new_tokens": CAP,
                                                              "decode_step_ms": {"1": 40.0, "10": 80.0}})


QUICK = FitConfig(max_epochs=25, patience=5, lr=1e-3)


@pytest.fixture(autouse=True)
def one_thread() -> Iterator[None]:
    """Tiny matrices: one thread is faster than two, and does not fight the rest of the suite for the cores."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def test_split_is_by_request_and_covers_every_request_once() -> None:
    split = split_by_request(200, seed=3)
    parts = [set(split.train.tolist()), set(split.val.tolist()), set(split.test.tolist())]
    assert [len(p) for p in parts] == [140, 30, 30]
    assert not (parts[0] & parts[1] or parts[0] & parts[2] or parts[1] & parts[2])
    assert set().union(*parts) == set(range(200))
    data = synthetic(60)
    split = split_by_request(data.requests, seed=1)
    masks = split.masks(data.rid)
    assert sum(m.astype(int) for m in masks).tolist() == [1] * len(data.rid)  # each sample in exactly one part
    for r in range(data.requests):  # and all of a request's samples in the same one
        assert len([i for i, m in enumerate(masks) if m[data.rid == r].any()]) == 1
    assert split_by_request(60, seed=1).test.tolist() == split.test.tolist()  # seeded
    assert split_by_request(60, seed=2).test.tolist() != split.test.tolist()
    with pytest.raises(ValueError):
        split_by_request(2)


def test_training_beats_the_mean_by_far() -> None:
    data = synthetic()
    split = split_by_request(data.requests)
    tr, va, te = split.masks(data.rid)
    y = data.remaining.astype(float)
    result = fit(data.hidden[tr], y[tr], data.hidden[va], y[va], QUICK)
    mae = float(np.abs(result.model.predict_tokens(data.hidden[te]) - y[te]).mean())
    mean_mae = float(np.abs(y[tr].mean() - y[te]).mean())
    assert mae < 0.3 * mean_mae, (mae, mean_mae)
    assert result.best_epoch >= 1 and result.val_mae == min(result.val_curve)


def test_early_stopping_keeps_the_best_epoch() -> None:
    data = synthetic(60)
    split = split_by_request(data.requests)
    tr, va, _ = split.masks(data.rid)
    y = data.remaining.astype(float)
    result = fit(data.hidden[tr], y[tr], data.hidden[va], y[va], FitConfig(max_epochs=200, patience=2, lr=1e-2))
    assert result.epochs < 200 and result.epochs - result.best_epoch <= 2
    assert result.val_mae == pytest.approx(min(result.val_curve))


def test_baseline_helpers() -> None:
    pos = np.array([0, 0, 20, 20, 40])
    rem = np.array([100.0, 50.0, 60.0, 40.0, 10.0])
    predict = mean_by_position(pos, rem)
    assert predict(np.array([0, 20, 40, 60, 30])).tolist() == [75.0, 50.0, 10.0, 10.0, 50.0]
    assert clamp_as_served(np.array([-5.0, 500.0, 30.0]), np.array([0, 100, 380]), 400).tolist() == [1, 300, 20]


def test_train_scores_every_method_and_writes_a_checkpoint_and_report(tmp_path: Path) -> None:
    data = synthetic(150)
    outcome = train(data, QUICK, measure_overhead=False, progress=lambda line: None)
    assert set(outcome.test_mae) == set(METHODS)
    assert outcome.test_mae[ARES] < min(outcome.test_mae[m] for m in PROMPT_ONLY)
    assert outcome.test_mae[ARES] < 0.5 * outcome.test_mae[MEAN]
    assert outcome.summary["best_prompt_only"] in PROMPT_ONLY
    assert outcome.summary["reduction_vs_best_prompt_only"] > 0 and outcome.summary["reduction_vs_best_auxiliary"] > 0
    assert outcome.meta.data_sha256 == data.content_sha256() and outcome.meta.hidden_size == D
    assert sum(outcome.meta.requests.values()) == data.requests
    save_checkpoint(outcome.model, outcome.meta, tmp_path)
    model, meta = load_checkpoint(tmp_path, hidden_size=D, model_name="Synthetic/Toy")
    assert meta.test_mae == pytest.approx(outcome.test_mae[ARES])
    paths = write_report(outcome, data, tmp_path, command="poise predictor train --data x --out y",
                         repeats=[outcome])
    text = paths["md"].read_text()
    assert "MAE of the ARES MLP against the best auxiliary-style predictor" in text and "By tokens generated" in text
    assert "### Other splits" in text and text.count("| ARES MLP's MAE vs") == 2
    assert paths["png"].stat().st_size > 10_000 and paths["json"].is_file()


def test_data_round_trips_through_npz_with_a_stable_content_hash(tmp_path: Path) -> None:
    data = synthetic(20)
    data.save(tmp_path / "a.npz")
    again = LengthData.load(tmp_path / "a.npz")
    assert again.content_sha256() == data.content_sha256()
    assert again.tasks == data.tasks and again.meta == data.meta
    np.testing.assert_array_equal(again.hidden, data.hidden)
    data.remaining[0] += 1
    assert data.content_sha256() != again.content_sha256()
