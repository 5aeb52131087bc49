"""The sustained comparison on two yardsticks side by side: the papers' (requests in time, clients that do not
retry) and the work yardstick (requests and tokens in time, no prompt-length quartile below 80%, clients that
retry a refusal twice after Retry-After; loadgen/sim/goodput.py's default).

Per workload, on each yardstick: the fixed split that was the oracle's on the request count (the committed
sustained table's ``static-best``; searching every split again on both yardsticks costs hours here), colocated
serving, Poise on its own engines (``poise``: FlowPrefill, operator preemption and give-up inside the engines,
engine_sim extensions SGLang does not run) and Poise on stock SGLang engines (``poise-sglang``: the same
controller and gateway rules; FCFS, chunked prefill, no give-up). ``--policies`` adds the data-plane baselines
(``colocated+poise-engines``, ``static-best+poise-engines``: Poise's engines and gateway without its
controller). Reported: each goodput, Poise's ratio to the better stock baseline, and at Poise's goodput the
share of requests and of tokens it refused and the tokens it served in time.

    python -m tests.bench.work_yardstick [--workloads a,b] [--policies p,q] [--jobs N]

Writes ``tests/bench/results/work_yardstick.{md,json,png}``; a run of some workloads replaces their rows.
"""

from __future__ import annotations

import argparse
import json
import shlex
import subprocess
import sys
import time
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import asdict
from pathlib import Path

from loadgen.sim.goodput import GoodputResult, Yardstick, at_goodput, search_goodput
from loadgen.slo import slo_for
from loadgen.traces import load_trace
from tests.bench.sustained import (
    BEST_ON_POISE_ENGINES,
    BISECTIONS,
    COLOCATED_POISE_ENGINES,
    MODEL,
    OUT,
    REPORTED,
    SEEN,
    TARGET,
    TUNE,
    mix_builder,
)

YARDSTICKS = {"requests": Yardstick(criterion="requests", client_retries=0), "work": Yardstick()}
RESULTS = OUT / "work_yardstick.json"
SUSTAINED = OUT / "sustained" / "sustained.json"
STOCK = ("static-best", "colocated")


def compare(workload: str, yardstick_name: str, policies: tuple[str, ...]) -> dict[str, object]:
    """Every mix's goodput on one workload and yardstick (one process: the searches are sequential)."""
    t0 = time.monotonic()
    y = YARDSTICKS[yardstick_name]
    w, slo = load_trace(workload), slo_for(workload)
    split = best_split(workload)
    search = {"target": TARGET, "bisections": BISECTIONS, "probe_above": 1, "yardstick": y}
    results: dict[str, GoodputResult] = {}
    for policy in policies:
        named = policy.replace("static-best", f"static-{split}")
        results[policy] = search_goodput(w, mix_builder(named), MODEL, slo, **search)  # type: ignore[arg-type]
    row: dict[str, object] = {"workload": workload, "yardstick": yardstick_name, "describe": y.describe(),
                              "best_split": split, "wall_s": round(time.monotonic() - t0, 1), "commit": commit(),
                              "goodput": {k: r.goodput_scale for k, r in results.items()}}
    row["at_goodput"] = {k: _work(r) for k, r in results.items()}
    row["curves"] = {k: [asdict(p) for p in r.points] for k, r in results.items()}
    return row


def commit() -> str:
    """The commit the code ran at (``+changes`` when the working tree differs from it)."""
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    dirty = subprocess.run(["git", "status", "--porcelain", "--", "services", "shared", "loadgen", "tests/bench",
                            ":(exclude)tests/bench/results"],
                           capture_output=True, text=True).stdout.strip()
    return (head or "unknown") + ("+changes" if dirty else "")


def best_split(workload: str) -> str:
    """The oracle fixed split of the committed sustained table (found on the request count)."""
    rows = json.loads(SUSTAINED.read_text())["rows"]
    row = next((r for r in rows if r["workload"] == workload), None)
    if row is None:
        sys.exit(f"{workload} has no row in {SUSTAINED}: run tests/bench/sustained.py for it first")
    return str(row["static_best_split"])


def _work(r: GoodputResult) -> dict[str, float] | None:
    at = at_goodput(r)
    return None if at is None else {
        "attainment": at.attainment, "token_attainment": at.token_attainment, "refused_share": at.refused_share,
        "refused_token_share": at.refused_token_share, "late_share": at.late_share,
        "min_quartile_attainment": at.min_quartile_attainment, "retries": at.retries}


def _ratio(goodput: dict[str, float], policy: str, against: tuple[str, ...]) -> float | None:
    base = max((goodput[k] for k in against if k in goodput), default=0.0)
    return goodput[policy] / base if base > 0 and policy in goodput else None


def _set(workload: str) -> str:
    return "tune" if workload in TUNE else "seen" if workload in SEEN else "held out"


def _pct(x: float) -> str:
    return f"{100 * x:.1f}%"


def table(rows: list[dict[str, object]]) -> str:
    lines = ["| workload | set | yardstick | policy | goodput (x trace rate) | vs better stock baseline | "
             "in time: requests / tokens | refused: requests / tokens | late | worst quartile |",
             "|---|---|---|---|---:|---:|---:|---:|---:|---:|"]
    for r in sorted(rows, key=lambda r: (ORDER.index(str(r["workload"])), str(r["yardstick"]) != "requests")):
        g: dict[str, float] = r["goodput"]  # type: ignore[assignment]
        work: dict[str, dict[str, float] | None] = r["at_goodput"]  # type: ignore[assignment]
        for policy in sorted(g, key=lambda k: (k not in STOCK, k)):
            at = work.get(policy)
            name = policy.replace("static-best", f"static-{r['best_split']}")
            ratio = _ratio(g, policy, STOCK)
            cells = ("- | - | - | -" if at is None else
                     f"{_pct(at['attainment'])} / {_pct(at['token_attainment'])} | {_pct(at['refused_share'])} / "
                     f"{_pct(at['refused_token_share'])} | {_pct(at['late_share'])} | "
                     f"{_pct(at['min_quartile_attainment'])}")
            lines.append(f"| {r['workload']} | {_set(str(r['workload']))} | {r['yardstick']} | {name} | "
                         f"{g[policy]:.2f} | {'-' if ratio is None or policy in STOCK else f'{ratio:.2f}x'} | {cells} |")
    return "\n".join(lines) + "\n"


def plot(rows: list[dict[str, object]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    workloads = [w for w in ORDER if any(r["workload"] == w for r in rows)]
    series = [(y, p) for p in ("poise", "poise-sglang") for y in YARDSTICKS]
    fig, ax = plt.subplots(figsize=(max(6.0, 2.2 * len(workloads) + 2), 4.2))
    width = 0.8 / len(series)
    for k, (yardstick, policy) in enumerate(series):
        values = []
        for w in workloads:
            row = next((r for r in rows if r["workload"] == w and r["yardstick"] == yardstick), None)
            values.append((_ratio(row["goodput"], policy, STOCK) or 0.0) if row else 0.0)  # type: ignore[arg-type]
        ax.bar([i + (k - (len(series) - 1) / 2) * width for i in range(len(workloads))], values, width,
               label=f"{policy}, {yardstick} yardstick")
    ax.axhline(1.0, color="gray", lw=1)
    ax.axhline(1.3, color="gray", ls="--", lw=1)
    ax.set_xticks(range(len(workloads)), workloads)
    ax.set_ylabel("goodput / better of fixed split and colocated")
    ax.set_title("Poise's margin on the papers' yardstick and on the work yardstick")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


ORDER = TUNE + REPORTED
DEFAULT_POLICIES = ("static-best", "colocated", "poise", "poise-sglang")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workloads", default=",".join(ORDER), help="comma-separated workloads")
    parser.add_argument("--policies", default=",".join(DEFAULT_POLICIES),
                        help=f"comma-separated: {', '.join(DEFAULT_POLICIES)}, {COLOCATED_POISE_ENGINES}, "
                             f"{BEST_ON_POISE_ENGINES}")
    parser.add_argument("--yardsticks", default=",".join(YARDSTICKS),
                        help=f"comma-separated: {', '.join(YARDSTICKS)} (the rows of the others are kept)")
    parser.add_argument("--jobs", type=int, default=1, help="simulations at once")
    args = parser.parse_args()
    workloads = [w.strip() for w in args.workloads.split(",") if w.strip()]
    yardsticks = [y.strip() for y in args.yardsticks.split(",") if y.strip()]
    if set(yardsticks) - set(YARDSTICKS):
        sys.exit(f"unknown yardsticks {sorted(set(yardsticks) - set(YARDSTICKS))}; known: {list(YARDSTICKS)}")
    policies = tuple(p.strip() for p in args.policies.split(",") if p.strip())
    unknown = sorted(set(workloads) - set(ORDER))
    if unknown:
        sys.exit(f"unknown workloads {unknown}; known: {ORDER}")
    command = shlex.join(["python", "-m", "tests.bench.work_yardstick", *sys.argv[1:]])
    old = json.loads(RESULTS.read_text()) if RESULTS.exists() else {"rows": []}
    rows = [r for r in old["rows"] if r["workload"] not in workloads or r["yardstick"] not in yardsticks]
    commands = sorted(set(old.get("commands", [])) | {command}) if rows else [command]
    with ProcessPoolExecutor(args.jobs) as pool:
        futures = {pool.submit(compare, w, y, policies): (w, y) for w in workloads for y in yardsticks}
        for future in as_completed(futures):
            row = future.result()
            rows.append(row)
            g: dict[str, float] = row["goodput"]  # type: ignore[assignment]
            print(f"{row['workload']} on {row['yardstick']}: "
                  + ", ".join(f"{k} {v:.2f}x" for k, v in g.items()) + f" ({row['wall_s']} s)", file=sys.stderr, flush=True)
            write(rows, commands)


def _commits(rows: list[dict[str, object]]) -> str:
    """Which commit each workload's rows were measured at (rows from before the bench recorded it: '-')."""
    by_workload: dict[str, set[str]] = {}
    for r in rows:
        by_workload.setdefault(str(r["workload"]), set()).add(str(r.get("commit") or "-"))
    return "Measured at: " + "; ".join(f"{w} {', '.join(sorted(c))}" for w, c in sorted(
        by_workload.items(), key=lambda kv: ORDER.index(kv[0])))


def write(rows: list[dict[str, object]], commands: list[str]) -> None:
    RESULTS.write_text(json.dumps({"commands": commands, "rows": rows}, indent=1))
    md = ["# Goodput on the papers' yardstick and on the work yardstick", "",
          "Commands: " + "; ".join(f"`{c}`" for c in commands), "",
          f"8 instances, Llama-3.1-8B/H100 profile, engine_sim's engine model, whole traces. Yardsticks: "
          f"requests = {YARDSTICKS['requests'].describe()}; work = {YARDSTICKS['work'].describe()}. Goodput in "
          f"multiples of each trace's own rate. The fixed split is the oracle's of the committed sustained table "
          f"(found on the request count). poise runs Poise's own engines (FlowPrefill, operator preemption, "
          f"give-up: engine_sim extensions); poise-sglang the same control plane on stock SGLang engines; "
          f"'+poise-engines' rows are Poise's engines and gateway without its controller. At each goodput: "
          f"requests and tokens served in time, the refused share of requests and of tokens, the late share and "
          f"the worst prompt-length quartile.", "", table(rows), "", _commits(rows), "",
          "![ratios](work_yardstick.png)", ""]
    (OUT / "work_yardstick.md").write_text("\n".join(md))
    plot(rows, OUT / "work_yardstick.png")


if __name__ == "__main__":
    main()
