"""The sustained comparison on two yardsticks side by side: the papers' (requests in time, clients that do not
retry) and the work yardstick (requests and tokens in time, no prompt-length quartile below 80%, clients that
retry a refusal twice after Retry-After; loadgen/sim/goodput.py's default).

Per workload, on each yardstick: the oracle fixed split (``static-best``, every split tried), colocated
serving, the same two on Poise's engines and gateway rules (Poise's data plane without its controller; the
split is the one best on the stock engines), and Poise starting at 4P4D. Reported: each goodput, Poise's
ratio to the better stock baseline and to the better data-plane baseline, and at Poise's goodput the share of
requests and of tokens it refused. Everything runs on engine_sim's engine model (Poise's engines run
FlowPrefill, operator preemption and give-up, which stock SGLang does not: the ``+poise-engines`` rows and
Poise's own are on those extensions).

    python -m tests.bench.work_yardstick [--workloads a,b] [--jobs N]

Writes ``tests/bench/results/work_yardstick.{md,json,png}``; a run of some workloads replaces their rows.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import time
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import asdict
from pathlib import Path

from loadgen.sim.goodput import GoodputResult, Yardstick, at_goodput, search_goodput, static_best
from loadgen.slo import slo_for
from loadgen.traces import load_trace
from tests.bench.sustained import (
    BEST_ON_POISE_ENGINES,
    BISECTIONS,
    COLOCATED_POISE_ENGINES,
    HELD_OUT,
    INSTANCES,
    MODEL,
    OUT,
    SEEN,
    TARGET,
    TUNE,
    mix_builder,
)

YARDSTICKS = {"requests": Yardstick(criterion="requests", client_retries=0), "work": Yardstick()}
RESULTS = OUT / "work_yardstick.json"
STOCK = ("static-best", "colocated")
DATA_PLANE = (BEST_ON_POISE_ENGINES, COLOCATED_POISE_ENGINES)


def compare(workload: str, yardstick_name: str) -> dict[str, object]:
    """Every mix's goodput on one workload and yardstick (one process: the searches are sequential)."""
    t0 = time.monotonic()
    y = YARDSTICKS[yardstick_name]
    w, slo = load_trace(workload), slo_for(workload)
    search = {"target": TARGET, "bisections": BISECTIONS, "probe_above": 1, "yardstick": y}
    best = static_best(w, INSTANCES, MODEL, slo, **search)  # type: ignore[arg-type]
    split = best.description.split(":")[1].split(",")[0].strip()  # "best fixed split: 6P2D, fixed roles, ..."
    results: dict[str, GoodputResult] = {"static-best": best}
    for policy in ("colocated", COLOCATED_POISE_ENGINES, f"static-{split}+poise-engines", "poise"):
        r = search_goodput(w, mix_builder(policy), MODEL, slo, **search)  # type: ignore[arg-type]
        results[BEST_ON_POISE_ENGINES if policy.startswith(f"static-{split}") else policy] = r
    row: dict[str, object] = {"workload": workload, "yardstick": yardstick_name, "describe": y.describe(),
                              "best_split": split, "wall_s": round(time.monotonic() - t0, 1),
                              "goodput": {k: r.goodput_scale for k, r in results.items()}}
    at = at_goodput(results["poise"])
    row["poise_at_goodput"] = None if at is None else {
        "attainment": at.attainment, "token_attainment": at.token_attainment, "refused_share": at.refused_share,
        "refused_token_share": at.refused_token_share, "late_share": at.late_share,
        "min_quartile_attainment": at.min_quartile_attainment, "retries": at.retries}
    row["curves"] = {k: [asdict(p) for p in r.points] for k, r in results.items()}
    return row


def _ratio(goodput: dict[str, float], against: tuple[str, ...]) -> float | None:
    base = max(goodput[k] for k in against)
    return goodput["poise"] / base if base > 0 else None


def _set(workload: str) -> str:
    return "tune" if workload in TUNE else "seen" if workload in SEEN else "held out"


def table(rows: list[dict[str, object]]) -> str:
    def x(v: float | None) -> str:
        return "-" if v is None else f"{v:.2f}x"

    lines = ["| workload | set | yardstick | static-best | colocated | best split + Poise's data plane | colocated + "
             "Poise's engines | Poise | Poise vs better stock | Poise vs better data plane | Poise refused: "
             "requests / tokens | Poise tokens in time |", "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in sorted(rows, key=lambda r: (ORDER.index(str(r["workload"])), str(r["yardstick"]) != "requests")):
        g: dict[str, float] = r["goodput"]  # type: ignore[assignment]
        at: dict[str, float] | None = r["poise_at_goodput"]  # type: ignore[assignment]
        refused = "-" if at is None else f"{100 * at['refused_share']:.1f}% / {100 * at['refused_token_share']:.1f}%"
        tokens = "-" if at is None else f"{100 * at['token_attainment']:.1f}%"
        lines.append(f"| {r['workload']} | {_set(str(r['workload']))} | {r['yardstick']} | {g['static-best']:.2f} "
                     f"({r['best_split']}) | {g['colocated']:.2f} | {g[BEST_ON_POISE_ENGINES]:.2f} | "
                     f"{g[COLOCATED_POISE_ENGINES]:.2f} | {g['poise']:.2f} | {x(_ratio(g, STOCK))} | "
                     f"{x(_ratio(g, DATA_PLANE))} | {refused} | {tokens} |")
    return "\n".join(lines) + "\n"


def plot(rows: list[dict[str, object]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    workloads = [w for w in ORDER if any(r["workload"] == w for r in rows)]
    fig, ax = plt.subplots(figsize=(11, 4.2))
    width = 0.2
    for k, (yardstick, against, label) in enumerate([
            ("requests", STOCK, "vs better stock, requests"), ("work", STOCK, "vs better stock, work"),
            ("requests", DATA_PLANE, "vs its data plane, requests"), ("work", DATA_PLANE, "vs its data plane, work")]):
        values = []
        for w in workloads:
            row = next((r for r in rows if r["workload"] == w and r["yardstick"] == yardstick), None)
            values.append((_ratio(row["goodput"], against) or 0.0) if row else 0.0)  # type: ignore[arg-type]
        ax.bar([i + (k - 1.5) * width for i in range(len(workloads))], values, width, label=label)
    ax.axhline(1.0, color="gray", lw=1)
    ax.axhline(1.3, color="gray", ls="--", lw=1)
    ax.set_xticks(range(len(workloads)), workloads, rotation=20)
    ax.set_ylabel("Poise goodput / baseline")
    ax.set_title("Poise's goodput ratio on the papers' yardstick (requests) and the work yardstick")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


ORDER = TUNE + [w for w in HELD_OUT if w not in TUNE]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workloads", default=",".join(ORDER), help="comma-separated workloads")
    parser.add_argument("--jobs", type=int, default=1, help="simulations at once")
    args = parser.parse_args()
    workloads = [w.strip() for w in args.workloads.split(",") if w.strip()]
    unknown = sorted(set(workloads) - set(ORDER))
    if unknown:
        sys.exit(f"unknown workloads {unknown}; known: {ORDER}")
    command = shlex.join(["python", "-m", "tests.bench.work_yardstick", *sys.argv[1:]])
    old = json.loads(RESULTS.read_text()) if RESULTS.exists() else {"rows": []}
    rows = [r for r in old["rows"] if r["workload"] not in workloads]
    commands = sorted(set(old.get("commands", [])) | {command}) if rows else [command]
    with ProcessPoolExecutor(args.jobs) as pool:
        futures = {pool.submit(compare, w, y): (w, y) for w in workloads for y in YARDSTICKS}
        for future in as_completed(futures):
            row = future.result()
            rows.append(row)
            g = row["goodput"]
            print(f"{row['workload']} on {row['yardstick']}: poise {g['poise']:.2f}x, "  # type: ignore[index]
                  f"static-best {g['static-best']:.2f}x, colocated {g['colocated']:.2f}x ({row['wall_s']} s)",  # type: ignore[index]
                  file=sys.stderr, flush=True)
            write(rows, commands)


def write(rows: list[dict[str, object]], commands: list[str]) -> None:
    RESULTS.write_text(json.dumps({"commands": commands, "rows": rows}, indent=1))
    md = ["# Goodput on the papers' yardstick and on the work yardstick", "",
          "Commands: " + "; ".join(f"`{c}`" for c in commands), "",
          f"8 instances, Llama-3.1-8B/H100 profile, engine_sim's engine model. Yardsticks: requests = "
          f"{YARDSTICKS['requests'].describe()}; work = {YARDSTICKS['work'].describe()}. Goodput in multiples of "
          f"each trace's own rate; 'stock' = the oracle fixed split and colocated serving on stock engines "
          f"(SGLang's FCFS, chunked prefill); 'data plane' = the same two on Poise's engines (FlowPrefill, "
          f"operator preemption, give-up: engine_sim extensions) and gateway rules, without its controller. "
          f"The refused shares and tokens in time are Poise's at its goodput.", "", table(rows),
          "", "![ratios](work_yardstick.png)", ""]
    (OUT / "work_yardstick.md").write_text("\n".join(md))
    plot(rows, OUT / "work_yardstick.png")


if __name__ == "__main__":
    main()

