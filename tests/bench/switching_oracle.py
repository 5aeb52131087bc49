"""Could a better P:D controller reach 1.3x? The switching oracle on the sustained yardstick.

The sustained bench (``tests.bench.sustained``) finds Poise level with the best fixed configuration on its
own engines, and ahead of the better stock baseline (the best fixed split and colocated serving on SGLang's
first come first served) by less than the issue's 1.3x. This asks whether any controller choosing among
those configurations could do better: every fixed split and colocated serving, all on Poise's engines, is
simulated at rates from Poise's goodput up to 1.3x the better stock baseline's (or 1.1x Poise's goodput,
where that is higher), and the switching oracle
(:mod:`loadgen.switching_oracle`: in each window of the run, the configuration that met the most SLOs
there, switching for free and with hindsight) is scored on the same requests. Windows of 300 s (the
controller's pace: at most one flip per instance in 5 minutes) are the main column, 60 s a sensitivity.

Poise runs at the same rates, so its attainment sits beside the oracle's. The yardstick is the sustained
bench's (whole trace, natural time, first 120 s not counted, 90% target, 8 instances); the rates come from
``tests/bench/results/sustained/sustained.json``, so run that bench first.

The configurations are the sustained bench's baselines on Poise's engines (least-load dispatch; the splits
with Poise's late binding and early rejection); with ``--data-plane`` they run the rest of Poise's data plane
too (Arrow's dispatch and DOPD's local prefill), so the oracle chooses among exactly what Poise's controller
chooses among.

Writes ``tests/bench/results/switching_oracle.{md,json,png}`` (``switching_oracle_data_plane.*`` with
``--data-plane``). ``--workloads a,b`` runs some workloads and
replaces their rows (each row keeps its command); ``--jobs N`` runs N simulations at once; ``--summarize``
rebuilds the table and plot from the JSON.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import shlex
import sys
import time
from concurrent.futures import ProcessPoolExecutor, as_completed
from pathlib import Path
from typing import Any

from loadgen.sim.baselines import PolicyMix, make_mix
from loadgen.sim.goodput import Yardstick
from loadgen.sim.run import simulate
from loadgen.slo import slo_for
from loadgen.switching_oracle import WindowCount, grid_goodput, rate_grid, switching_oracle, window_hits
from loadgen.traces import load_trace
from shared.policies.arrow import ArrowDispatch
from shared.protocol.messages import Role
from tests.bench.sustained import (
    COLOCATED_POISE_ENGINES,
    GOAL,
    INSTANCES,
    MODEL,
    ON_POISE_ENGINES,
    OUT,
    REPORTED,
    SEEN,
    SPLITS,
    SUMMARY,
    TARGET,
    TUNE,
    better_stock_goodput,
    mix_builder,
)

CONFIGS = [f"static-{s}{ON_POISE_ENGINES}" for s in SPLITS] + [COLOCATED_POISE_ENGINES]
# The same configurations with the rest of Poise's data plane too (--data-plane): Arrow's dispatch and DOPD's
# local prefill, which the sustained bench's baselines on Poise's engines leave at least-load.
DATA_PLANE = "+poise-data-plane"
DATA_PLANE_CONFIGS = [f"static-{s}{DATA_PLANE}" for s in SPLITS] + [f"colocated{DATA_PLANE}"]
FINE_S = 60.0  # the windows are kept at this grain; the 300-s oracle adds five of them up
WINDOWS_S = (300.0, 60.0)
POINTS = 3
# Where Poise is already past the goal, the rates still reach this far past its goodput: what a controller
# could add there.
PAST_POISE = 1.1


def data_plane_mix(config: str) -> PolicyMix:
    """Poise's data plane at one fixed configuration (``static-<split>`` or ``colocated``, with the
    :data:`DATA_PLANE` suffix): its engines, Arrow's SLO-aware dispatch and DOPD's local prefill, as the
    ``poise`` mix runs them, without the controller."""
    base = config.removesuffix(DATA_PLANE)
    poise = make_mix("poise", INSTANCES, None if base == "colocated" else base.removeprefix("static-"))
    roles: list[Role] = ["null"] * INSTANCES if base == "colocated" else poise.roles
    return dataclasses.replace(poise, name=config, roles=roles, description=f"{base}, Poise's data plane, no controller",
                               bind=lambda model, ctx: {"dispatch": ArrowDispatch(model, ctx)})


def _mix(policy: str) -> PolicyMix:
    return data_plane_mix(policy) if policy.endswith(DATA_PLANE) else mix_builder(policy)()


def _run(workload: str, policy: str, scale: float) -> tuple[str, str, float, list[WindowCount], float, float]:
    """One simulation: its per-window hits at :data:`FINE_S`, its attainment and its wall time."""
    w = load_trace(workload)
    slo = slo_for(workload)
    y = Yardstick()
    warmup = y.warmup_for(w, scale)
    t0 = time.monotonic()
    result = simulate(w, _mix(policy), MODEL, slo, rate_scale=scale, rate_mode=y.rate_mode,
                      warmup_s=warmup, seed=y.seed)
    counts = window_hits(result.records, slo, warmup, FINE_S)
    return workload, policy, scale, counts, result.summary.slo_attainment, time.monotonic() - t0


def _coarsen(counts: list[WindowCount], k: int) -> list[WindowCount]:
    return [(sum(h for h, _ in counts[i:i + k]), sum(n for _, n in counts[i:i + k])) for i in range(0, len(counts), k)]


def _targets(workload: str) -> tuple[float, float, float]:
    """(Poise's goodput, the better stock baseline's, the rate 1.3x above it) from the sustained summary."""
    rows = {r["workload"]: r for r in json.loads(SUMMARY.read_text())["rows"]}
    if workload not in rows:
        raise SystemExit(f"{workload}: no row in {SUMMARY}; run `python -m tests.bench.sustained --workloads "
                         f"{workload}` first")
    goodput = rows[workload]["goodput"]
    stock = better_stock_goodput(goodput)
    return goodput["poise"], stock, GOAL * stock


def analyse(row: dict[str, Any]) -> dict[str, Any]:
    """The oracle's attainment per rate and window, and the goodputs on the row's grid."""
    runs: dict[str, dict[str, list[WindowCount]]] = row["runs"]
    attain: dict[str, dict[str, float]] = row["attainment"]
    per_rate = []
    curves: dict[str, dict[float, float]] = {"poise": {}, "best fixed": {}}
    for scale in sorted(runs, key=float):
        configs = {c: runs[scale][c] for c in row.get("configs", CONFIGS)}
        entry: dict[str, Any] = {"rate_scale": float(scale), "poise": attain[scale]["poise"]}
        for window in WINDOWS_S:
            oracle = switching_oracle({c: _coarsen(v, int(window // FINE_S)) for c, v in configs.items()})
            entry[f"oracle_{window:g}s"] = oracle.attainment
            entry[f"switches_{window:g}s"] = oracle.switches
            curves.setdefault(f"oracle, {window:g}-s windows", {})[float(scale)] = oracle.attainment
            if window == WINDOWS_S[0]:
                entry["schedule_300s"] = oracle.schedule
                entry["best_fixed"] = oracle.best_fixed.removesuffix(ON_POISE_ENGINES).removesuffix(DATA_PLANE)
                entry["best_fixed_attainment"] = oracle.best_fixed_attainment
                curves["best fixed"][float(scale)] = oracle.best_fixed_attainment
        curves["poise"][float(scale)] = attain[scale]["poise"]
        per_rate.append(entry)
    goodputs = {name: grid_goodput(curve, TARGET) for name, curve in curves.items()}
    # How much more the oracle served in time than Poise at any one rate (percentage points; <= 0: never more).
    gaps = {f"{w:g}s": max(e[f"oracle_{w:g}s"] - e["poise"] for e in per_rate) for w in WINDOWS_S}
    return {"per_rate": per_rate, "grid_goodput": goodputs, "oracle_over_poise": gaps, "curves": {k: {str(s): a for s, a in v.items()}
                                                                       for k, v in curves.items()}}


def run_workloads(workloads: list[str], jobs: int, configs: list[str]) -> dict[str, dict[str, Any]]:
    plans: dict[str, dict[str, Any]] = {}
    for workload in workloads:
        poise, stock, goal = _targets(workload)
        plans[workload] = {"poise_goodput": poise, "better_stock_goodput": stock, "goal_scale": goal,
                           "scales": rate_grid(poise, max(goal, PAST_POISE * poise), POINTS)}
    tasks = [(w, p, s) for w, plan in plans.items() for s in plan["scales"] for p in [*configs, "poise"]]
    runs: dict[str, dict[str, dict[str, list[WindowCount]]]] = {w: {} for w in workloads}
    attain: dict[str, dict[str, dict[str, float]]] = {w: {} for w in workloads}
    t0 = time.monotonic()
    with ProcessPoolExecutor(jobs) as pool:
        futures = [pool.submit(_run, *t) for t in tasks]
        for done, future in enumerate(as_completed(futures), 1):
            workload, policy, scale, counts, attainment, wall = future.result()
            runs[workload].setdefault(str(scale), {})[policy] = counts
            attain[workload].setdefault(str(scale), {})[policy] = attainment
            print(f"  [{done}/{len(tasks)}, {time.monotonic() - t0:.0f} s] {workload} {policy} at {scale:g}x: "
                  f"{attainment:.1%} ({wall:.0f} s)", file=sys.stderr, flush=True)
    command = "python -m " + " ".join(["tests.bench.switching_oracle", *map(shlex.quote, sys.argv[1:])])
    rows = {}
    for workload, plan in plans.items():
        row = {"workload": workload, **plan, "configs": configs, "runs": runs[workload], "attainment": attain[workload],
               "command": command, "when": time.strftime("%Y-%m-%d", time.gmtime())}
        rows[workload] = {**row, **analyse(row)}
    return rows


def _pct(x: float) -> str:
    return f"{x:.1%}"


def write_report(rows: dict[str, dict[str, Any]], stem: str, data_plane: bool) -> None:
    order = [w for w in [*TUNE, *REPORTED] if w in rows]
    where = ("Poise's data plane (its engines, late binding, early rejection, Arrow's dispatch, DOPD's local "
             "prefill)" if data_plane
             else "Poise's engines (least-load dispatch, as the sustained bench's baselines; the splits with Poise's "
                  "late binding and early rejection)")
    commands = sorted({str(rows[w]["command"]) for w in order})
    lines = [
        "# The switching oracle: what a P:D controller could reach with hindsight",
        "",
        "Commands (each row's own is in switching_oracle.json): " + ", ".join(f"`{c}`" for c in commands),
        "",
        f"Every fixed split and colocated serving, all on {where}, simulated at the same rates as Poise "
        "on the sustained yardstick (whole trace, natural time, first 120 s not counted, 90% target, 8 "
        "instances); the switching oracle takes, in each window of the run, the configuration that met the most "
        "SLOs there (loadgen/switching_oracle.py: free switches, hindsight, each configuration's window as it "
        "served it running all along: an optimistic estimate for a controller, not a bound). Rates run from "
        "Poise's sustained goodput to 1.3x the better stock baseline's (the issue's goal), or to 1.1x Poise's "
        "goodput where that is higher, evenly on a log scale; a goodput here is the highest of these rates at which the curve and every lower one hold 90%.",
        "",
        "Rows are re-measured one workload at a time (`--workloads`) as the mix changes: each says when "
        "(UTC), and rows measured on an older mix describe that mix (docs/known-gaps.md).",
        "",
        "| workload | set | measured | better stock baseline | 1.3x of it | rate | poise | best fixed | "
        "oracle, 300-s windows (switches) | oracle, 60-s windows (switches) |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for w in order:
        row = rows[w]
        kind = "tune" if w in TUNE else "seen" if w in SEEN else "held-out"
        for k, e in enumerate(row["per_rate"]):
            head = (f"| {w} | {kind} | {row.get('when', '-')} | {row['better_stock_goodput']:.2f}x | "
                    f"{row['goal_scale']:.2f}x" if k == 0 else "| | | | |")
            lines.append(f"{head} | {e['rate_scale']:.4g}x | {_pct(e['poise'])} | {_pct(e['best_fixed_attainment'])} "
                         f"({e['best_fixed']}) | {_pct(e['oracle_300s'])} ({e['switches_300s']}) | "
                         f"{_pct(e['oracle_60s'])} ({e['switches_60s']}) |")
    lines += ["", "Goodput on each row's rates (highest rate where it and every lower one hold 90%; 0 = none):", "",
              "| workload | poise | best fixed | oracle, 300-s windows | oracle, 60-s windows | "
              "1.3x the better stock baseline | oracle reaches it | oracle's attainment over Poise's, most at any "
              "rate (300 s / 60 s) |", "|---|---|---|---|---|---|---|---|"]
    for w in order:
        row = rows[w]
        g = row["grid_goodput"]
        o300 = g["oracle, 300-s windows"]
        lines.append(f"| {w} | {g['poise']:g}x | {g['best fixed']:g}x | {o300:g}x | "
                     f"{g['oracle, 60-s windows']:g}x | {row['goal_scale']:.2f}x | "
                     f"{'yes' if o300 >= float(row['goal_scale']) - 1e-9 else 'no'} | "
                     f"{row['oracle_over_poise']['300s'] * 100:+.1f} / {row['oracle_over_poise']['60s'] * 100:+.1f} points |")
    lines += ["", "A goodput here sees only these rates: the sustained search's own points (its JSON) can show a "
              "failure between two of them (the natural-time draws differ by rate, so attainment moves by about a "
              "point from one rate to the next). Compare the curves rate by rate. The oracle's 300-s schedule at "
              "each rate is in the JSON (`per_rate[].schedule_300s`).", ""]
    (OUT / f"{stem}.md").write_text("\n".join(lines))
    panels = [(w, {name: {float(s): a for s, a in curve.items()} for name, curve in rows[w]["curves"].items()},
               float(rows[w]["goal_scale"])) for w in order]
    _plot(OUT / f"{stem}.png", panels, where)


def _plot(path: Path, panels: list[tuple[str, dict[str, dict[float, float]], float]], where: str) -> None:
    """Attainment against rate per workload: Poise, the best fixed configuration and the oracles."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cols = min(2, len(panels))
    rows = (len(panels) + cols - 1) // cols
    fig, axes = plt.subplots(rows, cols, figsize=(6 * cols, 3.6 * rows), squeeze=False)
    styles = {"poise": ("C0", "-", "o"), "best fixed": ("C2", "-", "s"), "oracle, 300-s windows": ("C3", "--", "^"),
              "oracle, 60-s windows": ("C1", ":", "v")}
    for ax, (workload, curves, goal) in zip(axes.flat, panels, strict=False):
        for name, curve in curves.items():
            color, line, marker = styles.get(name, ("k", "-", "."))
            xs = sorted(curve)
            ax.plot(xs, [curve[x] * 100 for x in xs], color=color, linestyle=line, marker=marker, label=name)
        ax.axhline(TARGET * 100, color="grey", linewidth=0.8)
        ax.axvline(goal, color="black", linestyle="--", linewidth=0.8)
        ax.set_title(f"{workload} (dashed: 1.3x the better stock baseline)", fontsize=9)
        ax.set_xlabel("rate scale (natural time)")
        ax.set_ylabel("SLO attainment (%)")
        ax.grid(alpha=0.3)
    for ax in list(axes.flat)[len(panels):]:
        ax.axis("off")
    axes.flat[0].legend(fontsize=8)
    fig.suptitle(f"Could a controller switching among fixed configurations reach 1.3x?\n{where}", fontsize=10)
    fig.tight_layout(rect=(0.0, 0.0, 1.0, 0.97))
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workloads", default=",".join(TUNE + ["stress-step", "stress-diurnal"]),
                        help="comma-separated; default: the tune set and the two held-out workloads")
    parser.add_argument("--jobs", type=int, default=2)
    parser.add_argument("--data-plane", action="store_true",
                        help="configurations with Poise's dispatch and local prefill too (-> switching_oracle_data_plane.*)")
    parser.add_argument("--summarize", action="store_true", help="rebuild the table and plot from the JSON")
    args = parser.parse_args()
    stem = "switching_oracle_data_plane" if args.data_plane else "switching_oracle"
    path = OUT / f"{stem}.json"
    if args.summarize and not path.exists():
        raise SystemExit(f"{path} does not exist: run the bench first (without --summarize)")
    rows: dict[str, dict[str, Any]] = json.loads(path.read_text()) if path.exists() else {}
    if not args.summarize:
        workloads = [w for w in args.workloads.split(",") if w]
        rows.update(run_workloads(workloads, args.jobs, DATA_PLANE_CONFIGS if args.data_plane else CONFIGS))
        path.write_text(json.dumps(rows))  # compact: per-minute counts of every run
    # The rows kept from earlier runs are analysed again too: the analysis may have grown since they were written.
    rows = {w: {**row, **analyse(row)} for w, row in rows.items()}
    write_report(rows, stem, args.data_plane)
    print((OUT / f"{stem}.md").read_text())


if __name__ == "__main__":
    main()
