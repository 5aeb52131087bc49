"""ARES Eq. 2: a 4-layer MLP from the last-token, last-layer hidden state to the remaining output length.

Widths come from the served model's hidden size d (``widths_for``). ARES used d = 3584 (R1-Distill-Qwen-7B)
with 2048/512/64; the rule reproduces that exactly and scales down for small models:

    m1 = 2 ** round(log2(4 d / 7))      # 4/7 of d, to a power of two: 3584 -> 2048, 4096 -> 2048, 576 -> 256
    m2 = m1 / 4                         # 2048 -> 512, 256 -> 64
    m3 = min(64, m2)                    # ARES's 64, unless the second layer is already narrower
    (floors of 32 and 16 keep toy sizes trainable; they do not bind for any real model)

The net predicts tokens / ``Y_SCALE`` (spec §1.2.4: train on y/1000 with L1); ``predict_tokens`` scales back
and clamps at 0. Inputs are standardised with the training set's per-feature mean and std, kept as buffers
in the checkpoint: an affine map that folds into W1 and a bias, so the function class is still Eq. 2's (with
biases, as the spec's reference does). A checkpoint is ``predictor.pt`` (state dict) plus ``predictor.json``
(metadata: the model it was trained for, hidden size, widths, k, data hash, MAEs, where the state is tapped).
"""

from __future__ import annotations

import datetime as dt
import json
import math
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from shared.errors import PoiseError

Y_SCALE = 1000.0  # the net's output unit: thousands of tokens
WEIGHTS_FILE = "predictor.pt"
META_FILE = "predictor.json"
FORMAT = "poise.predictor.v1"
# Where the hidden state is read (spec §1.12.5): exactly the tensor the LM head multiplies, i.e. after the
# final RMSNorm, at the last position. transformers >= 5 returns the same tensor as hidden_states[-1] for
# Llama models; SGLang's return_hidden_states gives it too (its Llama applies the norm before the logits).
TAP_POINT = "last token, final layer, after the final norm (the LM head's input)"


class PredictorCheckpointError(PoiseError):
    """A predictor checkpoint is missing, malformed, or was trained for another model."""


def widths_for(hidden_size: int) -> tuple[int, int, int]:
    """(m1, m2, m3) for a model of this hidden size; (2048, 512, 64) for ARES's d = 3584."""
    if hidden_size < 1:
        raise ValueError(f"hidden size must be positive, got {hidden_size}")
    m1 = max(32, 2 ** round(math.log2(4 * hidden_size / 7)))
    m2 = max(16, m1 // 4)
    return m1, m2, min(64, m2)


class LengthMLP(nn.Module):
    """h [B, d] -> remaining tokens / Y_SCALE [B]: three ReLU hidden layers and a scalar head (Eq. 2)."""

    input_mean: torch.Tensor  # buffers (saved with the weights), declared for the type checker
    input_std: torch.Tensor

    def __init__(self, hidden_size: int, widths: tuple[int, int, int] | None = None, bias: bool = True) -> None:
        super().__init__()
        self.hidden_size = hidden_size
        self.widths = widths or widths_for(hidden_size)
        m1, m2, m3 = self.widths
        self.net = nn.Sequential(
            nn.Linear(hidden_size, m1, bias=bias), nn.ReLU(),
            nn.Linear(m1, m2, bias=bias), nn.ReLU(),
            nn.Linear(m2, m3, bias=bias), nn.ReLU(),
            nn.Linear(m3, 1, bias=bias))
        self.register_buffer("input_mean", torch.zeros(hidden_size))
        self.register_buffer("input_std", torch.ones(hidden_size))

    def set_normalisation(self, x: np.ndarray) -> None:
        """Standardise inputs with the statistics of ``x`` (the training set); constant features keep std 1."""
        mean = torch.as_tensor(x.mean(axis=0), dtype=torch.float32)
        std = torch.as_tensor(x.std(axis=0), dtype=torch.float32)
        self.input_mean.copy_(mean)
        self.input_std.copy_(torch.where(std > 1e-6, std, torch.ones_like(std)))

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        x = (h.float() - self.input_mean) / self.input_std
        return self.net(x).squeeze(-1)

    def parameter_count(self) -> int:
        return sum(p.numel() for p in self.parameters())

    @torch.inference_mode()
    def predict_tokens(self, h: np.ndarray | torch.Tensor) -> np.ndarray:
        """Remaining tokens for each row of ``h``, clamped at 0 (float64 numpy)."""
        # on the MLP's device: an engine on a GPU hands in the states where they are, and only [B] comes back
        x = torch.as_tensor(h, dtype=torch.float32, device=self.input_mean.device)
        if x.dim() == 1:
            x = x.unsqueeze(0)
        # clamp and scale on the host: on a GPU each would be one more kernel launch for B numbers
        return np.maximum(self(x).cpu().numpy().astype(np.float64), 0.0) * Y_SCALE


def as_predict_fn(model: LengthMLP) -> Callable[[np.ndarray], np.ndarray]:
    """The plain function `online.ContinuousPredictor` calls: hidden states [B, d] -> remaining tokens [B]."""
    model.eval()
    return model.predict_tokens


@dataclass
class PredictorMeta:
    """What a checkpoint was trained for and how well it did: the JSON sidecar of ``predictor.pt``."""

    model_name: str
    hidden_size: int
    widths: tuple[int, int, int]
    k: int
    data_sha256: str
    tap_point: str = TAP_POINT
    y_scale: float = Y_SCALE
    bias: bool = True
    train_mae: float | None = None
    val_mae: float | None = None
    test_mae: float | None = None
    samples: dict[str, int] = field(default_factory=dict)
    requests: dict[str, int] = field(default_factory=dict)
    torch_version: str = torch.__version__
    created: str = field(default_factory=lambda: dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ"))
    extra: dict[str, Any] = field(default_factory=dict)
    format: str = FORMAT

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> PredictorMeta:
        raw = json.loads(text)
        if raw.get("format") != FORMAT:
            raise PredictorCheckpointError(f"not a {FORMAT} checkpoint (format {raw.get('format')!r})")
        known = {f for f in cls.__dataclass_fields__}
        meta = cls(**{k: v for k, v in raw.items() if k in known})
        meta.widths = (int(meta.widths[0]), int(meta.widths[1]), int(meta.widths[2]))
        return meta


def save_checkpoint(model: LengthMLP, meta: PredictorMeta, out_dir: Path) -> Path:
    """Write ``predictor.pt`` and ``predictor.json`` into ``out_dir``; returns the weights' path."""
    if meta.hidden_size != model.hidden_size or tuple(meta.widths) != tuple(model.widths):
        raise ValueError("metadata does not describe this model (hidden size or widths differ)")
    out_dir.mkdir(parents=True, exist_ok=True)
    weights = out_dir / WEIGHTS_FILE
    torch.save(model.state_dict(), weights)
    (out_dir / META_FILE).write_text(meta.to_json() + "\n")
    return weights


def load_checkpoint(path: Path, *, hidden_size: int | None = None,
                    model_name: str | None = None) -> tuple[LengthMLP, PredictorMeta]:
    """Load a checkpoint directory (or its ``predictor.pt``) for serving.

    ``hidden_size`` is the served model's: a predictor trained on another model's hidden states is refused,
    since its input would be meaningless even where the sizes happen to agree; ``model_name``, when given,
    must match too.
    """
    root = path.parent if path.suffix == ".pt" else path
    meta_path, weights = root / META_FILE, root / WEIGHTS_FILE
    if not meta_path.is_file() or not weights.is_file():
        raise PredictorCheckpointError(f"no predictor checkpoint in {root} (need {WEIGHTS_FILE} and {META_FILE})")
    meta = PredictorMeta.from_json(meta_path.read_text())
    if hidden_size is not None and hidden_size != meta.hidden_size:
        raise PredictorCheckpointError(
            f"predictor {root} was trained on hidden states of size {meta.hidden_size} ({meta.model_name}), "
            f"but the served model's hidden size is {hidden_size}: retrain it on this model's hidden states")
    if model_name is not None and model_name != meta.model_name:
        raise PredictorCheckpointError(
            f"predictor {root} was trained for {meta.model_name}, not {model_name}: retrain it for this model")
    model = LengthMLP(meta.hidden_size, meta.widths, bias=meta.bias)
    state = torch.load(weights, map_location="cpu", weights_only=True)
    try:
        model.load_state_dict(state)
    except RuntimeError as exc:
        raise PredictorCheckpointError(f"predictor weights in {weights} do not match its metadata: {exc}") from None
    model.eval()
    return model, meta
