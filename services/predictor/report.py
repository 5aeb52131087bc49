"""The training report: markdown tables, a JSON copy, and MAE against tokens generated per method (PNG)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from services.predictor.data import LengthData, task_summary
from services.predictor.train import ARES, AUXILIARY, METHODS, PREFILL_G, PROMPT_ONLY, TrainOutcome

# ARES Table 1 / §5.3, for the comparison line (spec §1.2.5).
ARES_REDUCTION = 0.4942
ARES_OVERHEAD_K20 = 0.0038


def markdown(outcome: TrainOutcome, data: LengthData, *, command: str, title: str = "ARES length predictor",
             repeats: list[TrainOutcome] | None = None) -> str:
    s, meta = outcome.summary, outcome.meta
    c = data.meta
    lines = [f"# {title}", "", f"Command: `{command}`", "",
             f"{meta.created}. Model {meta.model_name} (hidden size {meta.hidden_size}), CPU, "
             f"{c.get('threads', '?')} threads, torch {meta.torch_version}. Hidden state: {meta.tap_point}.", "",
             "## Data", "",
             f"{data.requests} requests from the project's prompt set (`services/predictor/prompts.py`), sampled "
             f"(seed {c.get('seed')}, {c.get('sampling')}), max_new_tokens {s['max_new_tokens']}, one sample at "
             f"the end of prefill and every k = {s['k']} generated tokens: {len(data.remaining)} samples. "
             f"{c.get('generated_tokens', '?')} tokens generated in {c.get('wall_s', '?')} s "
             f"({c.get('tokens_per_s', '?')} tok/s). Mean output {s['mean_output_len']:.0f} tokens; "
             f"{s['hit_cap_share']:.0%} of requests hit max_new_tokens. Data sha256 `{meta.data_sha256[:16]}…`.", "",
             "| task | requests | mean | min | median | max | hit cap |", "|---|---|---|---|---|---|---|"]
    for row in task_summary(data):
        lines.append(f"| {row['task']} | {row['requests']} | {row['mean']} | {row['min']} | {row['median']} | "
                     f"{row['max']} | {row['hit_cap']} |")
    lines += ["", "## Test MAE (held-out requests)", "",
              f"Split by request 70/15/15 (seed {meta.extra['fit']['seed']}): {meta.requests['train']}/"
              f"{meta.requests['val']}/{meta.requests['test']} requests, {meta.samples['train']}/{meta.samples['val']}/"
              f"{meta.samples['test']} samples. Every estimate is clamped as served: at least 1 token, at most "
              "max_new_tokens minus what was generated.", "",
              "| method | reads | test MAE (tokens) | vs ARES MLP |", "|---|---|---|---|"]
    reads = {"mean": "nothing", "mean by position": "tokens generated",
             "prompt MLP, once": "prompt text (predicts the total once, then counts down)",
             "prompt MLP + generated": "prompt text + tokens generated",
             "prefill-state MLP + generated": "LLM hidden state at end of prefill + tokens generated",
             ARES: "current last-token hidden state (every k tokens)"}
    for m in METHODS:
        mae = outcome.test_mae[m]
        lines.append(f"| {m} | {reads[m]} | {mae:.1f} | {mae / outcome.test_mae[ARES]:.2f}x |")
    aux, best = s["best_auxiliary"], s["best_prompt_only"]
    lines += ["", f"**MAE of the ARES MLP against the best auxiliary-style predictor ({aux}, which reads the prompt's "
              f"text): {-s['reduction_vs_best_auxiliary']:+.1%}** (ARES reports {-ARES_REDUCTION:+.1%} against its best "
              "auxiliary model, TetriInfer's OPT-125m, on ShareGPT with outputs up to 32K tokens). Against the best "
              f"prompt-only predictor of all ({best}): {-s['reduction_vs_best_prompt_only']:+.1%}; against the mean: "
              f"{-s['reduction_vs_mean']:+.1%}. Negative: the ARES MLP's MAE is lower.", "",
              "### By tokens generated (ARES Fig. 7)", "",
              "| generated | samples | " + " | ".join(METHODS) + " |", "|---|---|" + "---|" * len(METHODS)]
    buckets = [label for label, _, _ in outcome.by_bucket[ARES]]
    for i, label in enumerate(buckets):
        n = outcome.by_bucket[ARES][i][2]
        lines.append(f"| {label} | {n} | " + " | ".join(f"{outcome.by_bucket[m][i][1]:.1f}" for m in METHODS) + " |")
    lines += ["", "### By task type", "", "| task | " + " | ".join(METHODS) + " |", "|---|" + "---|" * len(METHODS)]
    for task, row in outcome.by_task.items():
        lines.append(f"| {task} | " + " | ".join(f"{row[m]:.1f}" for m in METHODS) + " |")
    fit = meta.extra["fit"]
    lines += ["", "## Training", "",
              f"L1 on remaining/1000, AdamW lr {fit['lr']}, weight decay {fit['weight_decay']}, batch "
              f"{fit['batch_size']}, up to {fit['max_epochs']} epochs, patience {fit['patience']} on validation MAE.", "",
              "| model | inputs | widths | parameters | best epoch / run | train MAE | val MAE | seconds |",
              "|---|---|---|---|---|---|---|---|"]
    for name, f in outcome.fits.items():
        lines.append(f"| {name} | {f.model.hidden_size} | {'/'.join(map(str, f.model.widths))} | "
                     f"{f.model.parameter_count():,} | {f.best_epoch} / {f.epochs} | {f.train_mae:.1f} | "
                     f"{f.val_mae:.1f} | {f.seconds:.1f} |")
    if outcome.overhead:
        threads = next(iter(outcome.overhead.values())).get("threads", "?")
        lines += ["", "## Overhead (CPU, median)", "",
                  f"The MLP on {threads} torch thread(s); the decode step as collected "
                  f"({c.get('threads', '?')} threads), ~60 tokens of context.", "",
                  "| batch | predictor | one SmolLM2 decode step | share of a step | overhead at k = "
                  f"{s['k']} |", "|---|---|---|---|---|"]
        for b, row in outcome.overhead.items():
            step = f"{row['decode_step_ms']:.1f} ms" if "decode_step_ms" in row else "-"
            share = f"{row['share_of_step']:.2%}" if "share_of_step" in row else "-"
            at_k = f"{row['overhead_at_k']:.4%}" if "overhead_at_k" in row else "-"
            lines.append(f"| {b} | {row['predictor_ms']:.3f} ms | {step} | {share} | {at_k} |")
        lines += ["", f"ARES: 1.40 ms at batch 10 against an 18.23 ms step (RTX 4090D, 7B), "
                  f"{ARES_OVERHEAD_K20:.2%} at k = 20."]
    if repeats:
        lines += seeds_table([outcome, *repeats])
    lines += ["", f"Plot: `{PLOT_NAME}`. Prompt-only methods: {', '.join(PROMPT_ONLY)}."]
    return "\n".join(lines) + "\n"


def seeds_table(outcomes: list[TrainOutcome]) -> list[str]:
    """Test MAE per split seed: 15% of a few hundred requests is a small test set, so say how much it moves."""
    seeds = [o.meta.extra["fit"]["seed"] for o in outcomes]
    lines = ["", "### Other splits", "",
             f"The same data, split and initialised with seeds {', '.join(map(str, seeds))}: test MAE (tokens).", "",
             "| method | " + " | ".join(f"seed {x}" for x in seeds) + " | mean |", "|---|" + "---|" * (len(seeds) + 1)]
    for m in METHODS:
        values = [o.test_mae[m] for o in outcomes]
        lines.append(f"| {m} | " + " | ".join(f"{v:.1f}" for v in values) + f" | {sum(values) / len(values):.1f} |")
    for label, baselines in (("best auxiliary-style", AUXILIARY), (PREFILL_G, (PREFILL_G,))):
        changes = [o.test_mae[ARES] / min(o.test_mae[b] for b in baselines) - 1 for o in outcomes]
        lines.append(f"| ARES MLP's MAE vs {label} | " + " | ".join(f"{c:+.1%}" for c in changes)
                     + f" | {sum(changes) / len(changes):+.1%} |")
    return lines


PLOT_NAME = "mae_vs_generated.png"


def plot(outcome: TrainOutcome, path: Path, title: str) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5))
    styles: dict[str, dict[str, Any]] = {ARES: {"linewidth": 2.5, "color": "black"}}
    for m in METHODS:
        rows = outcome.by_bucket[m]
        ax.plot(range(len(rows)), [mae for _, mae, _ in rows], marker="o", label=m, **styles.get(m, {}))
    labels = [f"{label}\n(n={n})" for label, _, n in outcome.by_bucket[ARES]]
    ax.set_xticks(range(len(labels)), labels, fontsize=8)
    ax.set_xlabel("tokens generated so far (test samples)")
    ax.set_ylabel("MAE of remaining length (tokens)")
    ax.set_title(title, fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def write_report(outcome: TrainOutcome, data: LengthData, out_dir: Path, *, command: str,
                 title: str = "ARES length predictor", repeats: list[TrainOutcome] | None = None) -> dict[str, Path]:
    """``report.md``, ``report.json`` and the plot in ``out_dir``; ``repeats`` are runs on other split seeds."""
    out_dir.mkdir(parents=True, exist_ok=True)
    md = out_dir / "report.md"
    md.write_text(markdown(outcome, data, command=command, title=title, repeats=repeats))
    document: dict[str, Any] = {"command": command, "summary": outcome.summary,
                                "other_seeds": [{"seed": o.meta.extra["fit"]["seed"], "test_mae": o.test_mae}
                                                for o in repeats or []],
                                "by_bucket": outcome.by_bucket,
                                "by_task": outcome.by_task, "overhead": outcome.overhead,
                                "checkpoint": json.loads(outcome.meta.to_json())}
    js = out_dir / "report.json"
    js.write_text(json.dumps(document, indent=2, default=str) + "\n")
    png = plot(outcome, out_dir / PLOT_NAME, f"{title}: MAE vs tokens generated ({data.meta.get('model', '')})")
    return {"md": md, "json": js, "png": png}
