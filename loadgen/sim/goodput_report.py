"""The goodput comparison as files: a Markdown table, JSON, and a PNG of the curves (Arrow Fig. 7 style)."""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path

from loadgen.sim.goodput import GoodputResult, at_goodput
from loadgen.slo import SLO


def goodput_table(results: list[GoodputResult], trace: str, slo: SLO, trace_rps: float) -> str:
    best = max((r.goodput_scale for r in results), default=0.0)
    yardstick = results[0].yardstick.describe() if results else ""
    lines = [f"Goodput on {trace} (90% in time with TTFT <= {slo.ttft_s:g} s and TPOT <= {slo.tpot_s:g} s; "
             f"{yardstick}; the trace's own rate is {trace_rps:.2f} req/s). At the goodput: requests and tokens "
             f"in time, refused (of requests / of tokens), served late, the worst prompt-length quartile.", "",
             "| policy | goodput (x trace rate) | goodput (req/s) | vs best | vs static-minload | vs colocated | "
             "requests / tokens in time | refused: requests / tokens | late | worst quartile | "
             "mean GPUs at goodput | mix |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    by_name = {r.policy: r.goodput_scale for r in results}

    def versus(r: GoodputResult, other: str) -> str:
        base = by_name.get(other)
        return f"{r.goodput_scale / base:.2f}x" if base else "-"

    def pct(x: float) -> str:
        return f"{100 * x:.1f}%"

    for r in sorted(results, key=lambda r: -r.goodput_scale):
        ratio = r.goodput_scale / best if best else 0.0
        at_least = ">= " if r.capped else ""
        point = at_goodput(r)
        if point is None:
            work = "- | - | - | - | -"
        else:
            work = (f"{pct(point.attainment)} / {pct(point.token_attainment)} | {pct(point.refused_share)} / "
                    f"{pct(point.refused_token_share)} | {pct(point.late_share)} | "
                    f"{pct(point.min_quartile_attainment)} | {point.mean_instances:.1f}")
        lines.append(f"| {r.policy} | {at_least}{r.goodput_scale:.2f} | {at_least}{r.goodput_rps:.2f} | {ratio:.2f} | "
                     f"{versus(r, 'static-minload')} | {versus(r, 'colocated')} | {work} | {r.description} |")
    return "\n".join(lines) + "\n"


def write_goodput_report(results: list[GoodputResult], out_dir: Path, *, trace: str, slo: SLO, trace_rps: float,
                         command: str) -> dict[str, Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = {"md": out_dir / "goodput.md", "json": out_dir / "goodput.json", "png": out_dir / "goodput.png"}
    paths["md"].write_text(f"# poise sim goodput\n\nCommand: `{command}`\n\n" + goodput_table(results, trace, slo, trace_rps))
    paths["json"].write_text(json.dumps({"command": command, "trace": trace, "slo": {"ttft_s": slo.ttft_s, "tpot_s": slo.tpot_s},
                                         "trace_rps": trace_rps, "results": [asdict(r) for r in results]}, indent=2))
    _plot(results, slo, trace, paths["png"])
    return paths


def _plot(results: list[GoodputResult], slo: SLO, trace: str, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import NullFormatter, ScalarFormatter

    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    for r in results:
        pts = sorted(r.points, key=lambda p: p.rate_rps)
        rates = [p.rate_rps for p in pts]
        line, = axes[0].plot(rates, [p.attainment * 100 for p in pts], "o-", ms=3, label=r.policy)
        axes[0].plot(rates, [p.token_attainment * 100 for p in pts], "--", lw=1, color=line.get_color())
        axes[1].plot(rates, [(p.ttft_p90_s or float("nan")) for p in pts], "o-", ms=3, label=r.policy)
        axes[2].plot(rates, [(p.tpot_p90_s or float("nan")) * 1000 for p in pts], "o-", ms=3, label=r.policy)
    axes[0].axhline(90, color="gray", ls="--", lw=1)
    axes[0].set_ylabel("in SLO (%): requests (solid), tokens (dashed)")
    axes[1].axhline(slo.ttft_s, color="gray", ls="--", lw=1)
    axes[1].set_ylabel("P90 TTFT (s)")
    axes[1].set_yscale("log")
    axes[2].axhline(slo.tpot_s * 1000, color="gray", ls="--", lw=1)
    axes[2].set_ylabel("P90 TPOT (ms)")
    for ax in axes:
        ax.set_xlabel("request rate (req/s)")
        ax.set_xscale("log")
        ax.grid(alpha=0.3)
        # Plain numbers on the log axes; unlabeled minor ticks (their labels overlap).
        for axis in (ax.xaxis, ax.yaxis) if ax is axes[1] else (ax.xaxis,):
            axis.set_major_formatter(ScalarFormatter())
            axis.set_minor_formatter(NullFormatter())
    axes[0].legend()
    fig.suptitle(f"poise sim goodput: {trace}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
