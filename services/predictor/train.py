"""Train ARES's length MLP and the baselines it is judged against, on one data set and one split by request.

Recipe (ARES §4.4, spec §1.2.4): L1 loss on remaining/1000, AdamW (lr 3e-4, weight decay 0.01), batch 64,
up to 100 epochs, early stop after 10 epochs without a better validation MAE, keeping the best epoch.

Methods, all scored by MAE in tokens on the test requests' samples, each estimate clamped the way the online
component clamps it (at least 1 token, at most ``max_new_tokens - generated``):

- ``mean``: the training samples' mean remaining length, for every sample.
- ``mean by position``: the training mean at the same number of generated tokens.
- ``prompt MLP, once``: the auxiliary-model approach (muServe, TetriInfer) at our scale: a regressor that reads
  only the prompt's text (hashed bag of words and bigrams, length, the number asked for: `prompts.
  prompt_features`) and predicts the output length once; during decode the estimate counts down.
- ``prompt MLP + generated``: the same features plus the count generated so far, trained on every sample,
  so it learns E[remaining | prompt, still running]: stronger than the papers' auxiliary baselines.
- ``prefill-state MLP + generated``: the LLM's own hidden state at the end of prefill (what ARES would attach
  at the P->D handoff) plus the count generated: the strongest prompt-only predictor here.
- ``ARES MLP``: Eq. 2 on the current last-token hidden state, re-predicted every k tokens.

The three prompt-only regressors are `model.LengthMLP`s too (widths from their input size) with the same
recipe, so the comparison is about what each one reads, not about how it was fitted.
"""

from __future__ import annotations

import copy
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch import nn

from services.predictor.data import LengthData, Split, split_by_request
from services.predictor.model import Y_SCALE, LengthMLP, PredictorMeta
from services.predictor.prompts import prompt_features

ARES = "ARES MLP"
MEAN = "mean"
MEAN_BY_POSITION = "mean by position"
PROMPT_ONCE = "prompt MLP, once"
PROMPT_G = "prompt MLP + generated"
PREFILL_G = "prefill-state MLP + generated"
AUXILIARY = (PROMPT_ONCE, PROMPT_G)  # read the prompt's text, as muServe's and TetriInfer's models do
PROMPT_ONLY = (*AUXILIARY, PREFILL_G)
METHODS = (MEAN, MEAN_BY_POSITION, PROMPT_ONCE, PROMPT_G, PREFILL_G, ARES)
BUCKETS = ((0, 0), (1, 40), (41, 80), (81, 120), (121, 160), (161, 200), (201, 1 << 30))


@dataclass(frozen=True)
class FitConfig:
    lr: float = 3e-4
    weight_decay: float = 0.01
    batch_size: int = 64
    max_epochs: int = 100
    patience: int = 10
    seed: int = 0


@dataclass
class FitResult:
    model: LengthMLP
    best_epoch: int
    epochs: int
    train_mae: float
    val_mae: float
    seconds: float
    val_curve: list[float] = field(default_factory=list)


def _mae(model: nn.Module, x: torch.Tensor, y: np.ndarray) -> float:
    with torch.inference_mode():
        pred = model(x).clamp_min(0.0).double().numpy() * Y_SCALE
    return float(np.mean(np.abs(pred - y)))


def fit(x_train: np.ndarray, y_train: np.ndarray, x_val: np.ndarray, y_val: np.ndarray, cfg: FitConfig,
        progress: Callable[[str], None] = lambda line: None, name: str = "") -> FitResult:
    """A `LengthMLP` from x to remaining tokens y, trained with the ARES recipe; the best validation epoch wins."""
    torch.manual_seed(cfg.seed)
    model = LengthMLP(x_train.shape[1])
    model.set_normalisation(x_train)
    xt, yt = torch.as_tensor(x_train, dtype=torch.float32), torch.as_tensor(y_train / Y_SCALE, dtype=torch.float32)
    xv = torch.as_tensor(x_val, dtype=torch.float32)
    optimiser = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
    loss_fn = nn.L1Loss()
    generator = torch.Generator().manual_seed(cfg.seed)
    best, best_epoch, best_state, curve = float("inf"), 0, copy.deepcopy(model.state_dict()), []
    t0 = time.monotonic()
    epoch = 0
    for epoch in range(1, cfg.max_epochs + 1):
        model.train()
        order = torch.randperm(len(xt), generator=generator)
        for start in range(0, len(xt), cfg.batch_size):
            batch = order[start:start + cfg.batch_size]
            optimiser.zero_grad()
            loss_fn(model(xt[batch]), yt[batch]).backward()
            optimiser.step()
        model.eval()
        val = _mae(model, xv, y_val)
        curve.append(val)
        if val < best:
            best, best_epoch, best_state = val, epoch, copy.deepcopy(model.state_dict())
        elif epoch - best_epoch >= cfg.patience:
            break
    model.load_state_dict(best_state)
    model.eval()
    result = FitResult(model=model, best_epoch=best_epoch, epochs=epoch, train_mae=_mae(model, xt, y_train),
                       val_mae=best, seconds=time.monotonic() - t0, val_curve=curve)
    progress(f"{name or 'fit'}: best val MAE {best:.1f} tokens at epoch {best_epoch}/{epoch} "
             f"({result.seconds:.1f}s, {model.parameter_count():,} parameters)")
    return result


def clamp_as_served(pred: np.ndarray, position: np.ndarray, max_new_tokens: int) -> np.ndarray:
    """What `online.ContinuousPredictor` would report: at least 1 token, at most what the cap leaves."""
    return np.minimum(np.maximum(pred, 1.0), np.maximum(max_new_tokens - position, 0))


def mean_by_position(position: np.ndarray, remaining: np.ndarray) -> Callable[[np.ndarray], np.ndarray]:
    """Mean remaining length at each generated count seen in training (the nearest lower one otherwise)."""
    keys = np.unique(position)
    means = np.array([remaining[position == p].mean() for p in keys])

    def predict(pos: np.ndarray) -> np.ndarray:
        idx = np.clip(np.searchsorted(keys, pos, side="right") - 1, 0, len(keys) - 1)
        return means[idx]

    return predict


def bucket_label(lo: int, hi: int) -> str:
    if lo == hi:
        return str(lo)
    return f"{lo}+" if hi >= 1 << 29 else f"{lo}-{hi}"


def mae_by_bucket(errors: np.ndarray, position: np.ndarray) -> list[tuple[str, float, int]]:
    """(bucket of tokens generated, MAE, samples) for each non-empty bucket, like ARES Fig. 7."""
    rows = []
    for lo, hi in BUCKETS:
        sel = (position >= lo) & (position <= hi)
        if sel.any():
            rows.append((bucket_label(lo, hi), float(errors[sel].mean()), int(sel.sum())))
    return rows


@torch.inference_mode()
def time_predictor(model: LengthMLP, batch_size: int, runs: int = 2000, warmup: int = 100) -> float:
    """Median seconds of one forward pass of ``model`` on ``batch_size`` hidden states (this machine's CPU)."""
    x = torch.randn(batch_size, model.hidden_size)
    times = []
    for i in range(warmup + runs):
        t0 = time.perf_counter()
        model(x)
        if i >= warmup:
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


@dataclass
class TrainOutcome:
    model: LengthMLP
    meta: PredictorMeta
    split: Split
    test_mae: dict[str, float]  # per method
    by_bucket: dict[str, list[tuple[str, float, int]]]  # per method
    by_task: dict[str, dict[str, float]]  # task -> method -> MAE
    fits: dict[str, FitResult]
    overhead: dict[str, Any]
    summary: dict[str, Any]


def _fit_methods(data: LengthData, split: Split, cfg: FitConfig, progress: Callable[[str], None]
                 ) -> tuple[dict[str, FitResult], dict[str, np.ndarray]]:
    """Fit ARES and every baseline on the training requests (early stopping on the validation ones); each
    method's fit and its predictions of the remaining length on every sample."""
    tr, va, _ = split.masks(data.rid)
    y = data.remaining.astype(np.float64)
    pos = data.position.astype(np.float64)
    fits: dict[str, FitResult] = {}
    preds: dict[str, np.ndarray] = {}
    # ARES: the current hidden state alone.
    fits[ARES] = fit(data.hidden[tr], y[tr], data.hidden[va], y[va], cfg, progress, ARES)
    preds[ARES] = fits[ARES].model.predict_tokens(data.hidden)
    # Baselines that read nothing but the position.
    preds[MEAN] = np.full(len(y), y[tr].mean())
    preds[MEAN_BY_POSITION] = mean_by_position(pos[tr], y[tr])(pos)
    # The prompt's text: once per request (at generated = 0, target = output length), then counted down ...
    features = np.stack([prompt_features(p) for p in data.prompts])
    first = data.position == 0
    f_first = features[data.rid[first]]
    req_tr, req_va = np.isin(data.rid[first], split.train), np.isin(data.rid[first], split.val)
    y_first = y[first]
    fits[PROMPT_ONCE] = fit(f_first[req_tr], y_first[req_tr], f_first[req_va], y_first[req_va], cfg, progress,
                            PROMPT_ONCE)
    total = fits[PROMPT_ONCE].model.predict_tokens(features)  # per request
    preds[PROMPT_ONCE] = total[data.rid] - pos
    # ... or with the generated count as an input, on every sample.
    g = (pos / Y_SCALE)[:, None].astype(np.float32)
    xp = np.hstack([features[data.rid], g])
    fits[PROMPT_G] = fit(xp[tr], y[tr], xp[va], y[va], cfg, progress, PROMPT_G)
    preds[PROMPT_G] = fits[PROMPT_G].model.predict_tokens(xp)
    # The LLM's prefill hidden state (its reading of the prompt) with the generated count.
    prefill_state = np.zeros((data.requests, data.hidden_size), dtype=np.float32)
    prefill_state[data.rid[first]] = data.hidden[first]
    xh = np.hstack([prefill_state[data.rid], g])
    fits[PREFILL_G] = fit(xh[tr], y[tr], xh[va], y[va], cfg, progress, PREFILL_G)
    preds[PREFILL_G] = fits[PREFILL_G].model.predict_tokens(xh)
    return fits, preds


def _overhead(model: LengthMLP, data: LengthData, k: int, progress: Callable[[str], None]) -> dict[str, Any]:
    """The predictor's own time at batch 1 and 10, against the decode step the collection timed."""
    overhead: dict[str, Any] = {}
    step_ms = {int(b): float(v) for b, v in data.meta.get("decode_step_ms", {}).items()}
    for b in (1, 10):
        t_pred = time_predictor(model, b) * 1000
        row: dict[str, Any] = {"predictor_ms": t_pred, "threads": torch.get_num_threads()}
        if b in step_ms:
            row["decode_step_ms"] = step_ms[b]
            row["share_of_step"] = t_pred / step_ms[b]
            row["overhead_at_k"] = t_pred / (k * step_ms[b])
        overhead[str(b)] = row
        progress(f"predictor batch {b}: {t_pred:.3f} ms" + (
            f" = {row['share_of_step']:.2%} of a decode step ({step_ms[b]:.1f} ms), "
            f"{row['overhead_at_k']:.4%} at k = {k}" if b in step_ms else ""))
    return overhead


def train(data: LengthData, cfg: FitConfig | None = None, *, measure_overhead: bool = True,
          progress: Callable[[str], None] = print) -> TrainOutcome:
    """Split ``data`` by request, fit the ARES MLP and the baselines, score them all on the test requests."""
    cfg = cfg or FitConfig()
    split = split_by_request(data.requests, seed=cfg.seed)
    tr, va, te = split.masks(data.rid)
    y = data.remaining.astype(np.float64)
    pos = data.position.astype(np.float64)
    k = int(data.meta.get("k", 20))
    cap = int(data.meta.get("max_new_tokens", int(data.output_len.max())))
    progress(f"{data.requests} requests, {len(y)} samples, hidden size {data.hidden_size}; split by request "
             f"{len(split.train)}/{len(split.val)}/{len(split.test)} ({int(tr.sum())}/{int(va.sum())}/{int(te.sum())} "
             "samples)")

    fits, preds = _fit_methods(data, split, cfg, progress)

    served = {m: clamp_as_served(preds[m], pos, cap) for m in METHODS}
    errors = {m: np.abs(served[m] - y) for m in METHODS}
    test_mae = {m: float(errors[m][te].mean()) for m in METHODS}
    by_bucket = {m: mae_by_bucket(errors[m][te], data.position[te]) for m in METHODS}
    tasks = np.array(data.tasks)[data.rid]
    by_task = {t: {m: float(errors[m][te & (tasks == t)].mean()) for m in METHODS}
               for t in sorted(set(data.tasks)) if (te & (tasks == t)).any()}
    best_prompt = min(PROMPT_ONLY, key=lambda m: test_mae[m])
    best_aux = min(AUXILIARY, key=lambda m: test_mae[m])
    reduction = 1.0 - test_mae[ARES] / test_mae[best_prompt]
    reduction_aux = 1.0 - test_mae[ARES] / test_mae[best_aux]
    summary = {
        "test_mae": test_mae, "best_prompt_only": best_prompt, "best_auxiliary": best_aux,
        "reduction_vs_best_prompt_only": reduction, "reduction_vs_best_auxiliary": reduction_aux,
        "reduction_vs_mean": 1.0 - test_mae[ARES] / test_mae[MEAN],
        "test_requests": len(split.test), "test_samples": int(te.sum()),
        "mean_output_len": float(data.output_len.mean()), "hit_cap_share": float(data.hit_cap.mean()),
        "max_new_tokens": cap, "k": k,
    }
    progress("test MAE (tokens): " + ", ".join(f"{m} {v:.1f}" for m, v in test_mae.items()))
    progress(f"ARES MLP's MAE vs the best auxiliary-style baseline ({best_aux}): {-reduction_aux:+.1%}; "
             f"vs the best prompt-only one ({best_prompt}): {-reduction:+.1%}")

    overhead = _overhead(fits[ARES].model, data, k, progress) if measure_overhead else {}

    ares = fits[ARES]
    meta = PredictorMeta(
        model_name=str(data.meta.get("model", "unknown")), hidden_size=data.hidden_size, widths=ares.model.widths,
        k=k, data_sha256=data.content_sha256(), train_mae=ares.train_mae, val_mae=ares.val_mae,
        test_mae=test_mae[ARES],
        samples={"train": int(tr.sum()), "val": int(va.sum()), "test": int(te.sum())},
        requests={"train": len(split.train), "val": len(split.val), "test": len(split.test)},
        extra={"fit": {"lr": cfg.lr, "weight_decay": cfg.weight_decay, "batch_size": cfg.batch_size,
                       "max_epochs": cfg.max_epochs, "patience": cfg.patience, "seed": cfg.seed,
                       "best_epoch": ares.best_epoch, "epochs": ares.epochs, "seconds": round(ares.seconds, 1)},
               "baselines_test_mae": {m: v for m, v in test_mae.items() if m != ARES},
               "reduction_vs_best_auxiliary": reduction_aux, "reduction_vs_best_prompt_only": reduction,
               "overhead": overhead,
               "parameters": ares.model.parameter_count(), "collection": data.meta})
    return TrainOutcome(model=ares.model, meta=meta, split=split, test_mae=test_mae, by_bucket=by_bucket,
                        by_task=by_task, fits=fits, overhead=overhead, summary=summary)
