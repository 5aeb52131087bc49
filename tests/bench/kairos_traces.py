"""Kairos and the composed default against FCFS + continuous batching on all three traces.

``tests/bench/kairos.py`` measures Kairos on Mooncake conversation, the long-tailed trace like Kairos' own;
this checks that ``poise`` keeps or improves Kairos' gain on the two Azure traces as well. Same simulator
setup (8 instances, 4P4D least-load for fcfs and kairos, Llama-3.1-8B/H100 profile, first 10 minutes), with
each trace's Arrow Table 1 SLO (the goodput benchmark's), at rates around fcfs' knee on that trace.

    python -m tests.bench.kairos_traces      # ~6 min on 2 cores; tests/bench/results/kairos_traces.{md,json,png}
"""

from __future__ import annotations

import shlex
import sys
import time
from pathlib import Path
from typing import Any

from loadgen.slo import slo_for
from loadgen.traces import load_trace
from shared.latency import LatencyModel, load_profile
from tests.bench.kairos import TABLE_HEAD, run_point, table_row, write_results

TRACES = {"azure-code": [4.0, 6.0, 8.0, 10.0, 12.0], "azure-conv": [16.0, 20.0, 24.0, 28.0, 32.0]}
MIXES = ("fcfs", "kairos", "poise")


def knee(rows: list[dict[str, Any]]) -> float | None:
    """The lowest rate at which fcfs falls under 90% end-to-end attainment (where Kairos reports its gains)."""
    under = [r["rate_scale"] for r in rows if r["mix"] == "fcfs" and r["e2e_attainment"] < 0.9]
    return min(under) if under else None


def _plot(rows: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(TRACES), figsize=(5 * len(TRACES), 3.5), squeeze=False)
    for ax, trace in zip(axes[0], TRACES, strict=True):
        for mix in MIXES:
            pts = [r for r in rows if r["trace"] == trace and r["mix"] == mix]
            ax.plot([p["rate_rps"] for p in pts], [p["e2e_attainment"] * 100 for p in pts], marker=".", label=mix)
        ax.axhline(90, color="grey", linewidth=0.8, linestyle="--")
        ax.set_title(f"{trace}: E2E attainment (%)", fontsize=9)
        ax.set_xlabel("req/s")
        ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main() -> None:
    command = shlex.join([Path(sys.executable).name, "-m", "tests.bench.kairos_traces", *sys.argv[1:]])
    model = LatencyModel(load_profile())
    rows: list[dict[str, Any]] = []
    for trace, scales in TRACES.items():
        workload = load_trace(trace).slice(0.0, 600.0)
        for mix in MIXES:
            for scale in scales:
                row = {"trace": trace, **run_point(workload, mix, slo_for(trace), scale, model)}
                rows.append(row)
                print(f"  {trace} {mix} {scale:g}x: e2e {row['e2e_attainment']:.1%} ({row['sim_wall_s']:.1f}s)",
                      file=sys.stderr, flush=True)
    lines = ["# Kairos and poise vs FCFS + continuous batching on the Azure traces", "", f"Command: `{command}`", "",
             f"{time.strftime('%Y-%m-%d %H:%M:%S UTC', time.gmtime())}, simulator, 8 instances (fcfs and kairos: "
             "4P4D least-load), Llama-3.1-8B/H100 profile, first 10 min of each trace, Arrow Table 1 SLOs. "
             "Attainment in %; points over fcfs at the same rate. Mooncake: `kairos.md`.", ""]
    for trace in TRACES:
        part = [r for r in rows if r["trace"] == trace]
        slo = slo_for(trace)
        at = knee(part)
        lines += [f"## {trace}: TTFT {slo.ttft_s:g} s, TPOT {slo.tpot_s * 1e3:g} ms; fcfs' knee: "
                  + (f"{at:g}x" if at is not None else "not reached"), "",
                  *TABLE_HEAD]
        for scale in TRACES[trace]:
            base = next(r for r in part if r["mix"] == "fcfs" and r["rate_scale"] == scale)
            lines += [table_row(r, base) for r in part if r["rate_scale"] == scale]
        lines.append("")
    write_results("kairos_traces", lines, rows, command, _plot)


if __name__ == "__main__":
    main()
