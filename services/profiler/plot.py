"""The PNG next to the profile: TTFT vs prompt length and decode step time vs batch, measured and fitted."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np

from services.profiler.fit import DecodeFit, PrefillFit, passes
from services.profiler.samples import DecodeSample, PrefillSample


def write_plot(path: Path, *, title: str, prefill_samples: Sequence[PrefillSample], prefill_fit: PrefillFit,
               chunk: int | None, decode_samples: Sequence[DecodeSample], decode_fit: DecodeFit) -> Path:
    """Render without pyplot, so no global backend state is touched (as loadgen/report.py)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(13, 5.5), layout="constrained")
    FigureCanvasAgg(fig)
    ttft_ax, step_ax = fig.subplots(1, 2)
    fig.suptitle(title)

    for s in prefill_samples:
        ttft_ax.scatter([s.tokens] * len(s.seconds), [x * 1e3 for x in s.seconds], s=10, color="tab:blue", alpha=0.35)
    ttft_ax.scatter([s.tokens for s in prefill_samples], [s.value_s(prefill_fit.statistic) * 1e3 for s in prefill_samples],
                    s=28, color="tab:blue", label=f"measured ({prefill_fit.statistic}; dots: repetitions)")
    top = max(s.tokens for s in prefill_samples)
    grid = np.unique(np.linspace(1, top, 400).astype(int))
    ttft_ax.plot(grid, [prefill_fit.predict_s(int(n), passes(int(n), chunk)) * 1e3 for n in grid], color="tab:red",
                 label=f"fit: o={prefill_fit.overhead_s * 1e3:.2f} ms/pass, a={prefill_fit.s_per_token:.3g}, "
                       f"b={prefill_fit.s_per_token2:.3g}")
    ttft_ax.set_xlabel("prompt tokens")
    ttft_ax.set_ylabel("TTFT, alone on an idle engine (ms)")
    ttft_ax.set_title(f"Prefill (R² {prefill_fit.stats.r2:.5f})")
    ttft_ax.grid(alpha=0.3)
    ttft_ax.legend(loc="upper left", fontsize=8)

    prompts = sorted({s.prompt_tokens for s in decode_samples})
    colors = [f"C{i % 10}" for i in range(len(prompts))]
    for prompt, color in zip(prompts, colors, strict=True):
        group = sorted((s for s in decode_samples if s.prompt_tokens == prompt), key=lambda s: s.batch)
        step_ax.scatter([s.batch for s in group], [s.step_s * 1e3 for s in group], s=22, color=color,
                        label=f"measured, {prompt}-token prompts")
        step_ax.scatter([s.batch for s in group], [decode_fit.predict_s(s.batch, s.context_tokens) * 1e3
                                                   for s in group], s=60, facecolors="none", edgecolors=color)
    step_ax.plot([], [], "o", mfc="none", mec="gray", label=(
        f"fit (open): {decode_fit.overhead_s * 1e3:.2f} ms + {decode_fit.s_per_seq * 1e6:.2f} us/seq "
        f"+ {decode_fit.s_per_context_token * 1e9:.2f} ns/context token"))
    step_ax.set_xscale("symlog", linthresh=4)
    step_ax.set_xlabel("batch size (sequences per step)")
    step_ax.set_ylabel("decode step (ms)")
    step_ax.set_title(f"Decode (R² {decode_fit.stats.r2:.5f})")
    step_ax.grid(alpha=0.3)
    step_ax.legend(loc="upper left", fontsize=8)
    fig.savefig(path, dpi=110)
    return path
