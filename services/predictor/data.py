"""The length-predictor data set: (hidden state, tokens generated, tokens remaining) samples of whole requests.

One ``.npz`` holds the samples (``hidden`` [S, d] float32, ``rid``/``position``/``remaining`` [S]) and the
requests they come from (task, prompt, output length, whether it hit ``max_new_tokens``, the text), plus the
collection's metadata as JSON. ``content_sha256`` hashes the arrays, not the file (zip entries carry
timestamps), so a checkpoint's ``data_sha256`` names the data it was trained on however it was copied.
"""

from __future__ import annotations

import hashlib
import json
import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np


@dataclass
class LengthData:
    hidden: np.ndarray  # [S, d] float32: the tapped hidden state of each sample
    rid: np.ndarray  # [S] int: index of the sample's request
    position: np.ndarray  # [S] int: tokens the request had generated when the hidden state was computed
    remaining: np.ndarray  # [S] int: tokens still to come, the one that forward pass produced included (>= 1)
    tasks: list[str]  # per request
    prompts: list[str]
    output_len: np.ndarray  # [R] int: tokens generated in all (stop token included)
    hit_cap: np.ndarray  # [R] bool: stopped by max_new_tokens rather than by the model
    outputs: list[str] = field(default_factory=list)  # per request: the generated text (for inspection)
    meta: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        s = self.hidden.shape[0]
        if not (self.rid.shape[0] == self.position.shape[0] == self.remaining.shape[0] == s):
            raise ValueError("sample arrays differ in length")
        if len(self.tasks) != len(self.prompts) or len(self.tasks) != self.output_len.shape[0]:
            raise ValueError("request arrays differ in length")

    @property
    def hidden_size(self) -> int:
        return int(self.hidden.shape[1])

    @property
    def requests(self) -> int:
        return len(self.tasks)

    def content_sha256(self) -> str:
        h = hashlib.sha256()
        for array in (self.hidden.astype(np.float32), self.rid.astype(np.int64), self.position.astype(np.int64),
                      self.remaining.astype(np.int64), self.output_len.astype(np.int64)):
            h.update(np.ascontiguousarray(array).tobytes())
        h.update(json.dumps([self.tasks, self.prompts]).encode())
        return h.hexdigest()

    def save(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        np.savez_compressed(
            path, hidden=self.hidden.astype(np.float32), rid=self.rid.astype(np.int32),
            position=self.position.astype(np.int32), remaining=self.remaining.astype(np.int32),
            tasks=np.array(self.tasks), prompts=np.array(self.prompts), output_len=self.output_len.astype(np.int32),
            hit_cap=self.hit_cap.astype(bool), outputs=np.array(self.outputs or [""] * self.requests),
            meta=np.array(json.dumps(self.meta)))

    @classmethod
    def load(cls, path: Path) -> LengthData:
        with np.load(path, allow_pickle=False) as f:
            return cls(hidden=f["hidden"].astype(np.float32), rid=f["rid"].astype(np.int64),
                       position=f["position"].astype(np.int64), remaining=f["remaining"].astype(np.int64),
                       tasks=[str(t) for t in f["tasks"]], prompts=[str(p) for p in f["prompts"]],
                       output_len=f["output_len"].astype(np.int64), hit_cap=f["hit_cap"].astype(bool),
                       outputs=[str(o) for o in f["outputs"]], meta=json.loads(str(f["meta"])))


@dataclass(frozen=True)
class Split:
    """Request indices of each part; every request is in exactly one."""

    train: np.ndarray
    val: np.ndarray
    test: np.ndarray

    def masks(self, rid: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Boolean sample masks for train, val and test."""
        return np.isin(rid, self.train), np.isin(rid, self.val), np.isin(rid, self.test)


def split_by_request(n_requests: int, fractions: tuple[float, float, float] = (0.70, 0.15, 0.15),
                     seed: int = 0) -> Split:
    """ARES §4.4: split requests (not samples) 70/15/15 at random, so no request's timesteps leak across parts.

    Val and test each get at least one request when there are three or more.
    """
    if n_requests < 3:
        raise ValueError(f"need at least 3 requests to split, got {n_requests}")
    if abs(sum(fractions) - 1.0) > 1e-9 or min(fractions) < 0:
        raise ValueError(f"fractions must be >= 0 and sum to 1, got {fractions}")
    order = np.random.default_rng(seed).permutation(n_requests)
    n_val = max(1, round(fractions[1] * n_requests))
    n_test = max(1, round(fractions[2] * n_requests))
    n_train = n_requests - n_val - n_test
    return Split(train=np.sort(order[:n_train]), val=np.sort(order[n_train:n_train + n_val]),
                 test=np.sort(order[n_train + n_val:]))


def task_summary(data: LengthData) -> list[dict[str, Any]]:
    """Output length by task type: what the prompt set produced."""
    rows = []
    for task in sorted(set(data.tasks)):
        lengths = [int(n) for n, t in zip(data.output_len, data.tasks, strict=True) if t == task]
        capped = sum(bool(c) for c, t in zip(data.hit_cap, data.tasks, strict=True) if t == task)
        rows.append({"task": task, "requests": len(lengths), "mean": round(statistics.fmean(lengths), 1),
                     "min": min(lengths), "median": statistics.median(lengths), "max": max(lengths),
                     "hit_cap": capped})
    return rows
