"""Continuous re-prediction (ARES §5.3): the length predictor runs on the whole running batch every k decode
iterations; in between, each estimate counts down with the tokens generated since (spec §1.2.6 [REC]).

This is what the component next to the engine runs. It imports no torch: the MLP comes in as a plain
function (``model.as_predict_fn``), so the schedule is tested with any function, and the hidden states come
in lazily, so an engine copies them off the accelerator only on the iterations that predict.

Conventions, the same as the training data's (``collect``): the hidden state of a forward pass is paired with
``generated`` = the tokens the request had generated when that pass ran (0 for the prefill pass, whose last
position is the last prompt token); the target is everything still to come, the token that pass produces
included. So a running request always has at least 1 token left, and never more than
``max_new_tokens - generated``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from shared.policies.length import counted_down

PredictFn = Callable[[Any], np.ndarray]
"""Hidden states [B, d] (numpy, or a tensor on the engine's device) -> predicted remaining tokens [B] (numpy)."""
HiddenSource = Any
"""The batch's last-token hidden states [B, d] (a numpy array, or a torch tensor where the predict function takes
one, e.g. on the engine's GPU), or a function that returns them (called only on the iterations that predict)."""

DEFAULT_K = 20  # ARES §5.3: 0.38% overhead at k = 20, against 7.7% at k = 1


@dataclass
class _Track:
    max_new_tokens: int
    generated: int = 0  # latest known
    predicted: float | None = None  # remaining tokens, as of generated_at
    generated_at: int = 0


class ContinuousPredictor:
    """Remaining-length estimates for one engine's running requests.

    ``step`` is called once per decode iteration with the running batch; every ``k``-th call runs
    ``predict`` on all of it. A request with no estimate yet (admitted without a prefill hidden state) is
    predicted at its first iteration, off the cycle; until then it is given ``max_new_tokens - generated``.
    """

    def __init__(self, predict: PredictFn, k: int = DEFAULT_K) -> None:
        if k < 1:
            raise ValueError(f"k must be >= 1, got {k}")
        self._predict = predict
        self.k = k
        self._tracks: dict[str, _Track] = {}
        self._predicted: set[str] = set()  # tracked rids that have an estimate
        # The last iteration's rows and their generated counts, as a dict only once ``remaining`` needs it
        self._last_rows: tuple[tuple[str, ...], tuple[int, ...]] = ((), ())
        self._latest: dict[str, int] | None = {}
        self.fresh: set[str] = set()  # rids predicted since the engine last took them (``take_fresh``)
        self._iterations = 0
        self.calls = 0  # predictor invocations (one per predicting iteration)
        self.rows = 0  # hidden states predicted, over all calls

    def admit(self, rid: str, max_new_tokens: int, *, generated: int = 0, hidden: np.ndarray | None = None) -> None:
        """Start tracking ``rid``; ``hidden`` is the last prompt token's hidden state from the prefill pass
        (the initial estimate ARES's P->D handoff may carry) or None to wait for the first decode iteration."""
        track = _Track(max_new_tokens=max_new_tokens, generated=generated, generated_at=generated)
        self._tracks[rid] = track
        self._predicted.discard(rid)
        if hidden is not None:
            track.predicted = float(self._run(np.asarray(hidden).reshape(1, -1))[0])
            self._predicted.add(rid)
            self.fresh.add(rid)

    def admit_batch(self, rids: Sequence[str], max_new_tokens: Sequence[int], hidden: HiddenSource) -> None:
        """``admit`` for the rows of one prefill pass, predicted in one call (rows of ``hidden`` in order)."""
        if len(rids) != len(max_new_tokens):
            raise ValueError("rids and max_new_tokens differ in length")
        if not rids:
            return
        states = hidden() if callable(hidden) else hidden
        predicted = self._run(states if hasattr(states, "shape") else np.asarray(states))
        for rid, cap, value in zip(rids, max_new_tokens, predicted, strict=True):
            self._tracks[rid] = _Track(max_new_tokens=cap, predicted=float(value))
        self._predicted.update(rids)
        self.fresh.update(rids)

    def release(self, rid: str) -> None:
        self._tracks.pop(rid, None)
        self._predicted.discard(rid)
        self.fresh.discard(rid)

    def take_fresh(self) -> set[str]:
        """The rids predicted since the last call (empty off the cycle), and forget them."""
        fresh, self.fresh = self.fresh, set()
        return fresh

    def __contains__(self, rid: str) -> bool:
        return rid in self._tracks

    def step(self, rids: Sequence[str], generated: Sequence[int], hidden: HiddenSource) -> bool:
        """One decode iteration of ``rids`` (the rows of ``hidden``, in order); True when it predicted.

        ``generated[i]`` is what request ``rids[i]`` had generated when this iteration's forward pass ran.
        Unknown rids are admitted with no ``max_new_tokens`` bound.
        """
        if len(rids) != len(generated):
            raise ValueError("rids and generated differ in length")
        self._iterations += 1
        # This runs every iteration: off the cycle, when every row has an estimate already (the usual case),
        # it costs C-level passes over the batch, not a Python loop (measured on an H100 decode loop:
        # tests/bench/gpu/serving_overhead.py).
        self._last_rows, self._latest = (tuple(rids), tuple(generated)), None
        due = self._iterations % self.k == 0
        if not due and self._predicted.issuperset(rids):
            return False
        rows = []
        for i, (rid, gen) in enumerate(zip(rids, generated, strict=True)):
            track = self._tracks.get(rid)
            if track is None:
                track = self._tracks[rid] = _Track(max_new_tokens=1 << 62, generated=gen, generated_at=gen)
            track.generated = gen
            if due or track.predicted is None:
                rows.append(i)
        states = hidden() if callable(hidden) else hidden
        if not hasattr(states, "shape"):
            states = np.asarray(states)
        if states.shape[0] != len(rids):
            raise ValueError(f"hidden has {states.shape[0]} rows for a batch of {len(rids)}")
        predicted = self._run(states if len(rows) == len(rids) else states[rows])
        for i, value in zip(rows, predicted, strict=True):
            track = self._tracks[rids[i]]
            track.predicted, track.generated_at = float(value), track.generated
            self._predicted.add(rids[i])
            self.fresh.add(rids[i])
        return True

    def remaining(self, rid: str, generated: int | None = None) -> float:
        """The estimate for ``rid`` now (at ``generated`` tokens, default the latest known)."""
        track = self._tracks[rid]
        if generated is None:
            if self._latest is None:
                self._latest = dict(zip(*self._last_rows, strict=True))
            generated = self._latest.get(rid, track.generated)
        cap = max(track.max_new_tokens - generated, 0)
        if track.predicted is None:
            return float(cap)
        return float(min(counted_down(track.predicted, track.generated_at, generated), cap))

    def predicted_at(self, rid: str) -> int | None:
        """How many tokens ``rid`` had generated when its estimate was last predicted (None: not yet)."""
        track = self._tracks[rid]
        return None if track.predicted is None else track.generated_at

    def estimates(self) -> dict[str, float]:
        """Every tracked request's current estimate (what a decode worker reports to the migrator)."""
        return {rid: self.remaining(rid) for rid in self._tracks}

    def _run(self, states: Any) -> np.ndarray:
        self.calls += 1
        self.rows += states.shape[0]
        out = np.asarray(self._predict(states), dtype=np.float64).reshape(-1)
        if out.shape[0] != states.shape[0]:
            raise ValueError(f"predict returned {out.shape[0]} values for {states.shape[0]} hidden states")
        return np.maximum(out, 0.0)
