"""Poise with and without its colocated mode, at given rates: what the mode choice costs where a split with
Poise's gateway serves more than colocated serving.

Runs the poise mix as it is (it may move the cluster into colocated serving) and with
``PoiseParams(colocated=False)`` (it only moves instances between prefill and decode), on the sustained
yardstick (whole trace, natural time, first 120 s not counted, 8 instances starting at 4P4D), one run per
rate. Writes ``tests/bench/results/poise_modes.{md,json}``; ``--workload`` and ``--rates`` pick the runs,
``--jobs N`` runs N simulations at once. Only reported: no parameter is chosen on it.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import shlex
import sys
from concurrent.futures import ProcessPoolExecutor
from typing import Any

from loadgen.sim.baselines import PolicyMix, make_mix
from loadgen.sim.goodput import Yardstick
from loadgen.sim.run import simulate
from loadgen.slo import slo_for
from loadgen.traces import load_trace
from shared.policies import ArrowDispatch
from shared.policies.poise import PoiseParams, PoisePools
from tests.bench.sustained import INSTANCES, MODEL, OUT, START

VARIANTS = ("poise", "poise, no colocated mode")


def _mix(variant: str) -> PolicyMix:
    mix = make_mix("poise", INSTANCES, START)
    if variant == "poise":
        return mix
    params = PoiseParams(colocated=False)
    return dataclasses.replace(mix, description=f"{mix.description}; no colocated mode",
                               bind=lambda model, ctx: {"dispatch": ArrowDispatch(model, ctx),
                                                        "pools": PoisePools(model, ctx, params)})


def _run(workload: str, variant: str, scale: float) -> dict[str, Any]:
    trace = load_trace(workload)
    y = Yardstick()
    r = simulate(trace, _mix(variant), MODEL, slo_for(workload), rate_scale=scale, rate_mode=y.rate_mode,
                 warmup_s=y.warmup_for(trace, scale), seed=y.seed)
    modes = r.config["lifecycle"]["timeline"][-1][1:]
    return {"workload": workload, "variant": variant, "rate_scale": scale, "attainment": r.summary.slo_attainment,
            "refused_share": r.config["early_rejections"] / max(1, len(r.records)), "final_roles": modes}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workload", default="stress-mix-shift")
    parser.add_argument("--rates", default="15.5,20,25")
    parser.add_argument("--jobs", type=int, default=2)
    args = parser.parse_args()
    rates = [float(x) for x in args.rates.split(",")]
    tasks = [(args.workload, v, s) for s in rates for v in VARIANTS]
    with ProcessPoolExecutor(args.jobs) as pool:
        rows = []
        for k, row in enumerate(pool.map(_run, *zip(*tasks, strict=True)), 1):
            print(f"[{k}/{len(tasks)}] {row['variant']} at {row['rate_scale']:g}x: {row['attainment']:.1%}",
                  file=sys.stderr, flush=True)
            rows.append(row)
    command = shlex.join(["python", "-m", "tests.bench.poise_modes", *sys.argv[1:]])
    (OUT / "poise_modes.json").write_text(json.dumps({"command": command, "rows": rows}, indent=1))
    lines = ["# Poise with and without its colocated mode", "", f"Command: `{command}`", "",
             "Sustained yardstick (whole trace, natural time, first 120 s not counted, 8 instances from 4P4D), one "
             "run per rate. Cells: % of requests in time (refused ones count as misses); in brackets, % refused "
             "early; the last column the instances at the end of the run (prefill, the rest: decode or colocated; "
             "0 prefill is colocated serving).", "",
             "| workload | rate (x trace) | " + " | ".join(VARIANTS) + " | roles at the end |", "|---|---|---|---|---|"]
    for s in rates:
        cells = {r["variant"]: r for r in rows if r["rate_scale"] == s}
        lines.append(f"| {args.workload} | {s:g} | " + " | ".join(
            f"{100 * cells[v]['attainment']:.1f} ({100 * cells[v]['refused_share']:.1f})" for v in VARIANTS)
            + " | " + ", ".join(f"{cells[v]['final_roles']}" for v in VARIANTS) + " |")
    (OUT / "poise_modes.md").write_text("\n".join(lines) + "\n")
    print("wrote tests/bench/results/poise_modes.{md,json}", file=sys.stderr)


if __name__ == "__main__":
    main()
