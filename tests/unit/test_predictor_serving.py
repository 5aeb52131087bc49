"""The predictor as a decode engine serves it: the checkpoint loaded for the served model, predictions at the
prefill pass and every k iterations, and the stream field on the first chunk and every k-th after it."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from services.predictor.model import LengthMLP, PredictorCheckpointError, PredictorMeta, save_checkpoint  # noqa: E402
from services.predictor.serving import EnginePredictor  # noqa: E402
from shared.protocol.length_prediction import PREDICTION_FIELD  # noqa: E402

HIDDEN = 8


def constant_checkpoint(tmp_path: Path, tokens: float, *, k: int = 4, hidden: int = HIDDEN) -> Path:
    """A checkpoint whose MLP predicts ``tokens`` for any state (the head's bias; its weight zeroed)."""
    model = LengthMLP(hidden)
    with torch.no_grad():
        model.net[-1].weight.zero_()
        model.net[-1].bias.fill_(tokens / 1000.0)
    save_checkpoint(model, PredictorMeta(model_name="Toy/LM", hidden_size=hidden, widths=model.widths, k=k,
                                         data_sha256="cd" * 32), tmp_path)
    return tmp_path


def test_load_refuses_another_models_checkpoint(tmp_path: Path) -> None:
    path = constant_checkpoint(tmp_path, 50.0)
    with pytest.raises(PredictorCheckpointError, match="hidden size is 16"):
        EnginePredictor.load(path, hidden_size=16)
    with pytest.raises(PredictorCheckpointError, match="not Other/LM"):
        EnginePredictor.load(path, hidden_size=HIDDEN, model_name="Other/LM")
    assert EnginePredictor.load(path, hidden_size=HIDDEN, model_name="Toy/LM").k == 4  # k from the checkpoint


def test_prefill_then_every_k_iterations_on_device_tensors(tmp_path: Path) -> None:
    syncs: list[int] = []
    engine = EnginePredictor.load(constant_checkpoint(tmp_path, 50.0), hidden_size=HIDDEN,
                                  sync=lambda: syncs.append(1))
    reads: list[int] = []

    def states(rows: int):  # what an engine hands in: a tensor where the model left it, read only when due
        def read() -> torch.Tensor:
            reads.append(rows)
            return torch.zeros(rows, HIDDEN, dtype=torch.bfloat16)
        return read

    engine.admit_batch(["a", "b"], [100, 30], states(2))
    assert engine.remaining("a", 0) == pytest.approx(50.0)
    assert engine.remaining("b", 0) == pytest.approx(30.0)  # never past what the cap leaves
    predicted = [engine.step(["a", "b"], [g, g], states(2)) for g in range(8)]
    assert predicted == [False, False, False, True] * 2  # every k = 4 iterations, the whole batch in one call
    assert reads == [2, 2, 2]  # the states were read at prefill and at the two predicting iterations only
    assert engine.remaining("a", 9) == pytest.approx(48.0)  # predicted 50 at g = 7, two generated since
    assert engine.online.calls == 3 and len(syncs) == 3 and engine.seconds > 0


def test_stream_fields_for_the_first_chunk_and_then_one_in_k(tmp_path: Path) -> None:
    engine = EnginePredictor.load(constant_checkpoint(tmp_path, 50.0), hidden_size=HIDDEN)
    state = np.zeros((1, HIDDEN), dtype=np.float32)
    engine.admit_batch(["a"], [200], state)  # the prefill pass, which makes token 1
    fields = {1: engine.stream_fields()}
    for g in range(1, 10):  # the decode pass at g generated tokens makes token g + 1
        engine.step(["a"], [g], state)
        fields[g + 1] = engine.stream_fields()
    assert [d for d, f in fields.items() if f] == [1, 5, 9]  # k = 4 iterations apart
    # Token 5's chunk: predicted 50 (token 5 included) by the pass at g = 4, so 49 still to come after it.
    assert fields[5] == {"a": {PREDICTION_FIELD: 49.0}}
    engine.admit_batch(["b"], [200], state)
    engine.release("b")
    assert engine.stream_fields() == {}  # a released request gets no field
