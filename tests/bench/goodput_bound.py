"""How far Poise's sustained goodput is from the ceiling: the work bound of ``loadgen.goodput_bound`` on every
workload of the sustained bench, beside the goodputs that bench measured.

Two ceilings, on the same yardstick and latency model as ``tests/bench/sustained.py`` (8 instances, natural
time, first 120 s not counted, 90% attainment, 4 bisections):

- the throughput bound: the scale past which 8 GPUs cannot do the work of every request, SLOs aside;
- the goodput bound: the scale past which no policy can meet the SLOs of 90% of the requests, even giving up
  the costliest ones first and packing the rest perfectly (above the throughput bound where the costliest
  tenth of the requests carries much of the work).

A policy's goodput lies below both, whatever its split, dispatch or scheduling. The question the bench answers
is whether the issue's 1.3x margin over the better stock baseline (the best fixed split or colocated serving)
is ruled out by the work itself. Reads ``tests/bench/results/sustained/sustained.json``; writes
``tests/bench/results/goodput_bound.{md,json,png}``.
"""

from __future__ import annotations

import json
import shlex
import sys
import time
from pathlib import Path

from loadgen.goodput_bound import goodput_bound, throughput_bound
from loadgen.slo import slo_for
from loadgen.traces import load_trace
from tests.bench.sustained import BISECTIONS, GOAL, INSTANCES, MODEL, OUT, SUMMARY, better_stock_goodput


def main() -> None:
    rows_in = json.loads(SUMMARY.read_text())["rows"]
    command = shlex.join(["python", "-m", "tests.bench.goodput_bound", *sys.argv[1:]])
    rows = []
    t0 = time.monotonic()
    for r in rows_in:
        workload = str(r["workload"])
        print(f"{workload} ({time.monotonic() - t0:.0f} s)", file=sys.stderr, flush=True)
        w = load_trace(workload)
        slo = slo_for(workload)
        g = r["goodput"]
        stock = better_stock_goodput(g)
        found = goodput_bound(w, MODEL, slo, INSTANCES, bisections=BISECTIONS)
        rows.append({
            "workload": workload, "set": r["set"], "poise": g["poise"], "better_stock": stock,
            "goal": GOAL * stock, "throughput_bound": throughput_bound(w, MODEL, slo, INSTANCES),
            "goodput_bound": found.goodput_scale,
            "bound_points": [{"rate_scale": s, "attainment_bound": b.attainment, "infeasible": b.infeasible,
                              "over_capacity": b.over_capacity, "cut_s": list(b.cut)} for s, b in found.points],
        })
    out = OUT / "goodput_bound"
    (out.with_suffix(".json")).write_text(json.dumps({"command": command, "rows": rows}, indent=1))
    (out.with_suffix(".md")).write_text(_table(rows, command))
    _plot(rows, out.with_suffix(".png"))
    print(out.with_suffix(".md").read_text())


def _table(rows: list[dict[str, object]], command: str) -> str:
    lines = [
        "# How far from the ceiling: Poise's sustained goodput against the work bound", "",
        f"Command: `{command}` (goodputs from `{SUMMARY}`, its own commands). Bounds from "
        "`loadgen/goodput_bound.py`: the throughput bound is the scale past which 8 GPUs cannot do every "
        "request's work on the latency model, SLOs aside; the goodput bound the scale past which no policy can "
        "meet the SLOs of 90% of the requests, giving up the costliest first and packing the rest perfectly. "
        "Scales are multiples of the trace's rate at natural time, 90% attainment, first 120 s not counted.", "",
        "| workload | set | poise | better stock (best fixed split or colocated) | 1.3x that | throughput bound "
        "| poise / throughput bound | goodput bound | poise / goodput bound | 1.3x |",
        "|---" * 10 + "|",
    ]
    for r in rows:
        goal, tb, gb = float(r["goal"]), float(r["throughput_bound"]), float(r["goodput_bound"])  # type: ignore[arg-type]
        if goal > gb:
            verdict = "ruled out by the work"
        elif goal > tb:
            verdict = "only by giving up the costliest requests"
        else:
            verdict = "within the bounds"
        lines.append(f"| {r['workload']} | {r['set']} | {r['poise']:.2f}x | {r['better_stock']:.2f}x | {goal:.2f}x | "
                     f"{tb:.2f}x | {float(r['poise']) / tb:.0%} | {gb:.2f}x | {float(r['poise']) / gb:.0%} | {verdict} |")  # type: ignore[arg-type]
    return "\n".join(lines) + "\n"


def _plot(rows: list[dict[str, object]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [str(r["workload"]) for r in rows]
    series = [("better stock", "better_stock", "#999999"), ("poise", "poise", "#1f77b4"),
              ("throughput bound", "throughput_bound", "#ff7f0e"), ("goodput bound", "goodput_bound", "#d62728")]
    fig, ax = plt.subplots(figsize=(13, 4.6))
    width = 0.2
    for k, (label, key, color) in enumerate(series):
        ax.bar([i + (k - 1.5) * width for i in range(len(rows))], [float(r[key]) for r in rows], width,  # type: ignore[arg-type]
               label=label, color=color)
    ax.scatter(range(len(rows)), [float(r["goal"]) for r in rows], marker="_", s=400, color="black", zorder=3,  # type: ignore[arg-type]
               label="1.3x better stock")
    ax.set_xticks(range(len(rows)), names, rotation=20)
    ax.set_yscale("log")
    ax.set_ylabel("rate scale (x trace rate, natural time)")
    ax.set_title("Sustained goodput against the work bound (8 instances, 90% attainment)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    main()
