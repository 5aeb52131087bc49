"""The length predictor as a decode engine runs it: the checkpoint loaded for the served model, ARES' continuous
re-prediction over the running batch, and the estimate put on the stream (``shared/protocol/length_prediction``).

This is the engine-side half of ARES (spec §1.2.6). A decode engine calls

- ``admit_batch`` after a prefill pass (or a P->D handoff) with the rows' last-prompt-token hidden states:
  the first estimate;
- ``step`` once per decode iteration, with the hidden states as a callable, so they are read (and, on a GPU,
  never copied: the MLP runs where they are) only on the iterations that predict;
- ``stream_fields`` once per iteration, for the chunks it is about to send: a field for each request just
  predicted (all of them every k iterations, newcomers at once), nothing off the cycle, so the engine's
  per-request work does not grow; the gateway reads ``poise_predicted_remaining`` and offers it to the
  migrator;
- ``release`` when the request leaves.

The project's decode loop (``decode.Decoder``) runs it with SmolLM2 in ``poise predictor online``, and the GPU
benchmark (``tests/bench/gpu/serving_overhead.py``) at 8B scale. An SGLang decode worker needs the same four calls in
its model runner; that hook is not written (services/predictor/README.md, "SGLang").
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from services.predictor.model import LengthMLP, PredictorMeta, as_predict_fn, load_checkpoint
from services.predictor.online import ContinuousPredictor, HiddenSource, PredictFn
from shared.protocol.length_prediction import PREDICTION_FIELD


class EnginePredictor:
    """One decode engine's remaining-length predictions, with the time they cost.

    ``seconds`` is the wall time spent in the MLP, device synchronisation included (``sync`` is called after
    each prediction, e.g. ``torch.cuda.synchronize``, so the time is the predictor's and not the next kernel's).
    """

    def __init__(self, model: LengthMLP, meta: PredictorMeta, *, k: int | None = None,
                 sync: Any = None, predict: PredictFn | None = None) -> None:
        """``predict`` replaces the model's own call, e.g. with a replay of it captured in a CUDA graph."""
        self.meta = meta
        self.k = k or meta.k
        self._sync = sync
        self.seconds = 0.0
        mlp = predict or as_predict_fn(model)

        def timed(states: Any) -> Any:
            t0 = time.perf_counter()
            out = mlp(states)  # returns numpy: the copy back to the host is the sync
            if self._sync is not None:
                self._sync()
            self.seconds += time.perf_counter() - t0
            return out

        self.online = ContinuousPredictor(timed, k=self.k)

    @classmethod
    def load(cls, path: Path, *, hidden_size: int, model_name: str | None = None, k: int | None = None,
             device: str = "cpu", sync: Any = None) -> EnginePredictor:
        """Load ``path`` for the served model; refused (``PredictorCheckpointError``) when it was trained on
        another model's hidden states."""
        model, meta = load_checkpoint(path, hidden_size=hidden_size, model_name=model_name)
        return cls(model.to(device), meta, k=k, sync=sync)

    def admit_batch(self, rids: Sequence[str], max_new_tokens: Sequence[int], hidden: HiddenSource) -> None:
        self.online.admit_batch(rids, max_new_tokens, hidden)

    def step(self, rids: Sequence[str], generated: Sequence[int], hidden: HiddenSource) -> bool:
        return self.online.step(rids, generated, hidden)

    def remaining(self, rid: str, generated: int) -> float:
        """Tokens ``rid`` still has to generate once it has ``generated`` of them."""
        return self.online.remaining(rid, generated)

    def stream_fields(self) -> dict[str, dict[str, float]]:
        """``{rid: {"poise_predicted_remaining": tokens}}`` to merge into the chunks of the requests predicted
        since the last call: a request's first chunk, then one chunk in k, the cadence engine_sim streams at.

        A pass run at ``g`` generated tokens produces token ``g + 1``, so its chunk carries what is still to come
        after that token. Empty, at no cost, on the iterations that predict nothing."""
        fresh = self.online.take_fresh()
        out = {}
        for rid in fresh:
            at = self.online.predicted_at(rid)
            if at is not None:
                out[rid] = {PREDICTION_FIELD: round(self.online.remaining(rid, at + 1), 1)}
        return out

    def release(self, rid: str) -> None:
        self.online.release(rid)
