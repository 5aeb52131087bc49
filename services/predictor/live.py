"""``poise predictor online``: the trained checkpoint served live, as a decode engine runs it.

The decode loop (``decode.Decoder``) generates the checkpoint's held-out prompts (its test split, which it never
trained on) with fresh sampling, and loads the checkpoint through ``serving.EnginePredictor`` exactly as an
engine would: refused for another model, predicting at prefill and every k decode iterations, counting down
in between. After each forward pass every running request's estimate is recorded, so the error is measured
the way the migrator meets it (at every token, not only where a prediction was just made).

Compared on the same (request, tokens generated) points:
- ``max_tokens``: the cap minus what was generated: all a server knows without a predictor;
- ``mean, counted down``: the training requests' mean output length minus what was generated;
- ``mean by position``: the training samples' mean remaining length at that many generated tokens.

The overhead is the predictor's wall time (its calls, the copy of the states they read included) as a share of
the decode iterations' wall time, measured in the loop.
"""

from __future__ import annotations

import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from services.predictor.data import LengthData, split_by_request
from services.predictor.decode import Decoder, Generated, Sampling
from services.predictor.llm import LoadedLLM
from services.predictor.model import PredictorCheckpointError
from services.predictor.prompts import Prompt
from services.predictor.serving import EnginePredictor
from services.predictor.train import mae_by_bucket, mean_by_position

ONLINE = "ARES MLP, online"
BASELINES = ("max_tokens", "mean, counted down", "mean by position")


def held_out_prompts(data: LengthData, split_seed: int, limit: int | None = None) -> list[Prompt]:
    """The test split's prompts (by request, as ``train`` split them), in request order."""
    test = split_by_request(data.requests, seed=split_seed).test
    chosen = test if limit is None else test[:limit]
    return [Prompt(f"test-{int(i)}", data.tasks[i], data.prompts[i]) for i in chosen]


def _baselines(data: LengthData, split_seed: int, cap: int) -> dict[str, Callable[[np.ndarray], np.ndarray]]:
    split = split_by_request(data.requests, seed=split_seed)
    train_mask = np.isin(data.rid, split.train)
    mean_len = float(data.output_len[split.train].mean())
    by_position = mean_by_position(data.position[train_mask], data.remaining[train_mask])

    def clamp(pred: np.ndarray, g: np.ndarray) -> np.ndarray:
        return np.minimum(np.maximum(pred, 1.0), cap - g)

    return {"max_tokens": lambda g: (cap - g).astype(float),
            "mean, counted down": lambda g: clamp(mean_len - g, g),
            "mean by position": lambda g: clamp(by_position(g), g)}


def evaluate(records: list[Generated], baselines: dict[str, Callable[[np.ndarray], np.ndarray]]) -> dict[str, Any]:
    """MAE of the online estimates and the baselines over every recorded (request, generated) point."""
    g = np.array([pos for r in records for pos, _, _ in r.estimates])
    est = np.array([e for r in records for _, e, _ in r.estimates])
    fresh = np.array([f for r in records for _, _, f in r.estimates])
    truth = np.array([len(r.tokens) - pos for r in records for pos, _, _ in r.estimates])
    methods = {ONLINE: est, **{name: f(g) for name, f in baselines.items()}}
    errors = {name: np.abs(pred - truth) for name, pred in methods.items()}
    by_bucket = {name: mae_by_bucket(err, g) for name, err in errors.items()}
    return {"points": int(len(g)), "predicted_points": int(fresh.sum()),
            "mae": {n: float(e.mean()) for n, e in errors.items()},
            "mae_where_predicted": {n: float(e[fresh].mean()) for n, e in errors.items()},
            "by_bucket": by_bucket}


def run_online(llm: LoadedLLM, checkpoint: Path, data: LengthData, *, max_new_tokens: int | None = None,
               limit: int | None = None, seed: int = 1, batch_size: int = 32, k: int | None = None,
               progress: Callable[[str], None] = print) -> dict[str, Any]:
    """Serve ``checkpoint`` in the decode loop on ``data``'s held-out prompts; the measurements as a dict."""
    predictor = EnginePredictor.load(checkpoint, hidden_size=llm.hidden_size, model_name=llm.name, k=k)
    if predictor.meta.data_sha256 != data.content_sha256():
        raise PredictorCheckpointError(
            f"{checkpoint} was trained on data {predictor.meta.data_sha256[:12]}…, not on this file's "
            f"{data.content_sha256()[:12]}…: its test split would not be held out")
    split_seed = int(predictor.meta.extra.get("fit", {}).get("seed", 0))
    cap = max_new_tokens or int(data.meta.get("max_new_tokens", 256))
    prompts = held_out_prompts(data, split_seed, limit)
    from services.predictor.collect import stop_ids

    decoder = Decoder(llm.model, llm.tokenizer, stop_ids=stop_ids(llm), max_new_tokens=cap, k=0,
                      sampling=Sampling(), seed=seed, batch_size=batch_size, predictor=predictor)
    t0 = time.monotonic()
    records: list[Generated] = []
    for record in decoder.run(prompts):
        records.append(record)
        if len(records) % 16 == 0 or len(records) == len(prompts):
            progress(f"{len(records)}/{len(prompts)} held-out requests, {decoder.steps} decode steps, "
                     f"{time.monotonic() - t0:.0f}s")
    result = evaluate(records, _baselines(data, split_seed, cap))
    lengths = [len(r.tokens) for r in records]
    result.update({
        "checkpoint": str(checkpoint), "model": llm.name, "k": predictor.k, "split_seed": split_seed,
        "sampling_seed": seed, "requests": len(records), "max_new_tokens": cap, "batch_size": batch_size,
        "output_len": {"mean": round(statistics.fmean(lengths), 1), "max": max(lengths)},
        "hit_cap": sum(r.hit_cap for r in records), "decode_steps": decoder.steps,
        "predictor_calls": predictor.online.calls, "predicted_rows": predictor.online.rows,
        "predictor_s": predictor.seconds, "decode_s": decoder.step_seconds,
        "overhead": predictor.seconds / decoder.step_seconds if decoder.step_seconds else None,
        "offline_test_mae": predictor.meta.test_mae, "wall_s": round(time.monotonic() - t0, 1),
    })
    return result


def markdown(result: dict[str, Any], command: str) -> str:
    mae, where = result["mae"], result["mae_where_predicted"]
    lines = [
        "# ARES length predictor, served online", "",
        f"Command: `{command}`", "",
        f"{result['requests']} held-out requests (split seed {result['split_seed']}), sampled afresh (seed "
        f"{result['sampling_seed']}), {result['model']}, cap {result['max_new_tokens']} tokens "
        f"(mean output {result['output_len']['mean']}, {result['hit_cap']} hit the cap), k = {result['k']}, "
        f"{result['batch_size']} in flight. {result['points']} (request, tokens generated) points.", "",
        "| estimate | MAE, every token | MAE, where the MLP just predicted (prefill, then every k-th iteration) |",
        "|---|---|---|",
    ]
    for name in (ONLINE, *BASELINES):
        lines.append(f"| {name} | {mae[name]:.1f} | {where[name]:.1f} |")
    lines += ["", f"Offline test MAE of this checkpoint (collected generations, prediction points only): "
              f"{result['offline_test_mae']:.1f}.", "",
              "| tokens generated | " + " | ".join(result["by_bucket"][ONLINE][i][0]
                                                  for i in range(len(result["by_bucket"][ONLINE]))) + " |",
              "|---|" + "---|" * len(result["by_bucket"][ONLINE])]
    for name in (ONLINE, *BASELINES):
        lines.append(f"| {name} | " + " | ".join(f"{m:.1f}" for _, m, _ in result["by_bucket"][name]) + " |")
    lines += ["", f"Overhead in the loop: {result['predictor_calls']} predictor calls on {result['predicted_rows']} "
              f"hidden states took {result['predictor_s'] * 1000:.0f} ms, {result['overhead']:.3%} of "
              f"{result['decode_s']:.1f} s of decode iterations ({result['decode_steps']} steps).", ""]
    return "\n".join(lines)


def plot(result: dict[str, Any], path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5))
    for name in (ONLINE, *BASELINES):
        rows = result["by_bucket"][name]
        style: dict[str, Any] = {"linewidth": 2.5, "color": "black"} if name == ONLINE else {}
        ax.plot(range(len(rows)), [m for _, m, _ in rows], marker="o", label=name, **style)
    rows = result["by_bucket"][ONLINE]
    ax.set_xticks(range(len(rows)), [f"{label}\n(n={n})" for label, _, n in rows], fontsize=8)
    ax.set_xlabel("tokens generated so far (every token of every held-out request)")
    ax.set_ylabel("MAE of remaining length (tokens)")
    ax.set_title(f"Served online in the decode loop ({result['model']}, k = {result['k']})", fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def write_online_report(result: dict[str, Any], out_dir: Path, command: str, stem: str = "online") -> dict[str, Path]:
    """``<stem>.md``, ``<stem>.json`` and the plot ``<stem>.png`` in ``out_dir``."""
    out_dir.mkdir(parents=True, exist_ok=True)
    md, js, png = out_dir / f"{stem}.md", out_dir / f"{stem}.json", out_dir / f"{stem}.png"
    md.write_text(markdown(result, command) + f"\n![MAE vs tokens generated]({png.name})\n")
    js.write_text(json.dumps({"command": command, **result}, indent=2) + "\n")
    return {"md": md, "json": js, "png": plot(result, png)}
