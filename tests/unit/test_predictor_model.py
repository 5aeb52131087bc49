"""The ARES length MLP: widths from the hidden size, checkpoints with metadata, refusal of another model's."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from services.predictor.model import (  # noqa: E402
    META_FILE,
    TAP_POINT,
    LengthMLP,
    PredictorCheckpointError,
    PredictorMeta,
    as_predict_fn,
    load_checkpoint,
    save_checkpoint,
    widths_for,
)


def test_widths_reproduce_ares_and_scale_down() -> None:
    assert widths_for(3584) == (2048, 512, 64)  # ARES Eq. 2 for R1-Distill-Qwen-7B
    assert widths_for(576) == (256, 64, 64)  # SmolLM2-135M
    assert widths_for(4096) == (2048, 512, 64)
    assert widths_for(16) == (32, 16, 16)  # floors for toy sizes
    with pytest.raises(ValueError):
        widths_for(0)


def test_parameter_count_matches_ares_table_1() -> None:
    model = LengthMLP(3584)
    assert model.parameter_count() == 8_424_065  # "8.4 M" (spec §1.2.2, with biases)
    layers = [m for m in model.net if isinstance(m, torch.nn.Linear)]
    assert [(m.in_features, m.out_features) for m in layers] == [(3584, 2048), (2048, 512), (512, 64), (64, 1)]


def test_predictions_are_tokens_and_never_negative() -> None:
    torch.manual_seed(0)
    model = LengthMLP(8)
    with torch.no_grad():
        model.net[-1].bias.fill_(-5.0)  # push every output below zero
    out = model.predict_tokens(np.random.default_rng(0).normal(size=(4, 8)).astype(np.float32))
    assert out.shape == (4,) and (out >= 0).all()
    with torch.no_grad():
        model.net[-1].weight.zero_()
        model.net[-1].bias.fill_(0.25)
    assert as_predict_fn(model)(np.zeros((3, 8), dtype=np.float32)) == pytest.approx([250.0] * 3)  # y/1000 scale
    assert model.predict_tokens(np.zeros(8, dtype=np.float32)).shape == (1,)  # one vector is a batch of one


def _meta(model: LengthMLP, **kw: object) -> PredictorMeta:
    fields = {"model_name": "Toy/Model", "hidden_size": model.hidden_size, "widths": model.widths, "k": 20,
              "data_sha256": "ab" * 32, "test_mae": 12.5}
    fields.update(kw)
    return PredictorMeta(**fields)  # type: ignore[arg-type]


def test_checkpoint_round_trip_keeps_weights_normalisation_and_metadata(tmp_path: Path) -> None:
    torch.manual_seed(1)
    model = LengthMLP(12)
    x = np.random.default_rng(1).normal(3.0, 2.0, size=(50, 12)).astype(np.float32)
    model.set_normalisation(x)
    save_checkpoint(model, _meta(model), tmp_path)
    loaded, meta = load_checkpoint(tmp_path, hidden_size=12, model_name="Toy/Model")
    np.testing.assert_allclose(loaded.predict_tokens(x), model.predict_tokens(x), rtol=1e-6)
    assert torch.equal(loaded.input_mean, model.input_mean) and torch.equal(loaded.input_std, model.input_std)
    assert (meta.model_name, meta.hidden_size, meta.widths, meta.k) == ("Toy/Model", 12, model.widths, 20)
    assert meta.data_sha256 == "ab" * 32 and meta.test_mae == 12.5
    assert meta.tap_point == TAP_POINT and meta.torch_version == torch.__version__ and meta.created
    sidecar = json.loads((tmp_path / META_FILE).read_text())
    assert sidecar["hidden_size"] == 12 and sidecar["format"] == "poise.predictor.v1"
    assert load_checkpoint(tmp_path / "predictor.pt")[1].hidden_size == 12  # the .pt path works too


def test_a_checkpoint_for_another_hidden_size_is_refused(tmp_path: Path) -> None:
    model = LengthMLP(12)
    save_checkpoint(model, _meta(model), tmp_path)
    with pytest.raises(PredictorCheckpointError, match=r"size 12 \(Toy/Model\).*hidden size is 576"):
        load_checkpoint(tmp_path, hidden_size=576)
    with pytest.raises(PredictorCheckpointError, match="trained for Toy/Model, not Other/Model"):
        load_checkpoint(tmp_path, hidden_size=12, model_name="Other/Model")


def test_missing_or_inconsistent_checkpoints_are_refused(tmp_path: Path) -> None:
    with pytest.raises(PredictorCheckpointError, match="no predictor checkpoint"):
        load_checkpoint(tmp_path)
    model = LengthMLP(12)
    save_checkpoint(model, _meta(model), tmp_path)
    raw = json.loads((tmp_path / META_FILE).read_text())
    raw["widths"] = [64, 16, 16]  # metadata that does not describe the weights
    (tmp_path / META_FILE).write_text(json.dumps(raw))
    with pytest.raises(PredictorCheckpointError, match="do not match its metadata"):
        load_checkpoint(tmp_path)
    with pytest.raises(ValueError):
        save_checkpoint(model, _meta(model, hidden_size=13), tmp_path)
