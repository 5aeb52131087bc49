"""Tune-set sweep of the Poise controller's hysteresis ``min_gain``: goodput on the tuning workloads only.

The sustained yardstick (``loadgen.sim.goodput`` defaults, 8 instances, starting at 4P4D) on ``TUNE`` of
``tests.bench.sustained`` (the two Azure 2023 traces) for each value of ``--values``. The held-out set is not
run here: a value is chosen on these rows alone, and the held-out workloads are then reported with it by
``tests.bench.sustained``. Writes ``tests/bench/results/poise_tuning.{md,json}``.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import shlex
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from typing import Any

from loadgen.sim.baselines import PolicyMix, make_mix
from loadgen.sim.goodput import search_goodput
from loadgen.slo import slo_for
from loadgen.traces import load_trace
from shared.latency import LatencyModel
from shared.policies.context import PolicyContext
from shared.policies.poise import PoiseParams, PoisePools
from tests.bench.sustained import BISECTIONS, INSTANCES, MODEL, OUT, START, TARGET, TUNE


def _mix(min_gain: float) -> PolicyMix:
    mix = make_mix("poise", INSTANCES, START)
    base = mix.bind
    assert base is not None

    def bind(model: LatencyModel, ctx: PolicyContext) -> dict[str, Any]:
        return {**base(model, ctx), "pools": PoisePools(model, ctx, PoiseParams(min_gain=min_gain))}

    return dataclasses.replace(mix, bind=bind)


def _task(workload: str, min_gain: float) -> dict[str, Any]:
    t0 = time.monotonic()
    result = search_goodput(load_trace(workload), functools.partial(_mix, min_gain), MODEL, slo_for(workload),
                            target=TARGET, bisections=BISECTIONS, probe_above=1)
    print(f"  {workload} min_gain={min_gain}: {result.goodput_scale:.2f}x ({time.monotonic() - t0:.0f} s)",
          file=sys.stderr, flush=True)
    at = max((p for p in result.points if p.rate_scale <= result.goodput_scale), key=lambda p: p.rate_scale,
             default=None)
    return {"workload": workload, "min_gain": min_gain, "goodput_scale": result.goodput_scale,
            "non_monotone": result.non_monotone, "flips_at_goodput": at.flips if at else None,
            "max_flips_per_instance_5min": max((p.max_flips_per_instance_5min for p in result.points), default=0)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--values", default="0.1,0.15,0.25,0.35")
    parser.add_argument("--jobs", type=int, default=2)
    args = parser.parse_args()
    values = [float(v) for v in args.values.split(",")]
    command = shlex.join(["python", "-m", "tests.bench.poise_tuning", *sys.argv[1:]])
    with ProcessPoolExecutor(args.jobs) as pool:
        rows = list(pool.map(_task, [w for w in TUNE for _ in values], [v for _ in TUNE for v in values]))
    (OUT / "poise_tuning.json").write_text(json.dumps({"command": command, "rows": rows}, indent=1))
    lines = ["# Poise controller: min_gain on the tune set", "", f"Command: `{command}`", "",
             "Sustained yardstick (natural time, whole traces, first 120 s not counted, 90% attainment), "
             f"{INSTANCES} instances from {START}. Tune set only: {', '.join(TUNE)}.", "",
             "| min_gain | " + " | ".join(f"{w} goodput | {w} flips at goodput" for w in TUNE) + " | sum |",
             "|---|" + "---|---|" * len(TUNE) + "---|"]
    for v in values:
        cells = [r for w in TUNE for r in rows if r["workload"] == w and r["min_gain"] == v]
        lines.append(f"| {v} | " + " | ".join(f"{r['goodput_scale']:.2f}x | {r['flips_at_goodput']}" for r in cells)
                     + f" | {sum(r['goodput_scale'] for r in cells):.2f} |")
    (OUT / "poise_tuning.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
