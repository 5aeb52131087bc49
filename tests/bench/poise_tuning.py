"""Choosing the Poise controller's hysteresis ``min_gain``: goodput per candidate on the tune set, then on
the seen set.

The sustained yardstick (``loadgen.sim.goodput`` defaults, 8 instances, starting at 4P4D) for each value of
``--values`` on ``--sets``: ``tune`` (the two Azure 2023 traces, ``TUNE`` of ``tests.bench.sustained``) and
``seen`` (Mooncake conversation, ``SEEN``: a validation set, used to check a candidate, never to fit one). The
rule (docs/evaluation.md): the largest value with the best tune-set goodput sum among those that hold up on
the seen set: goodput not below the best fixed split's, and (``tests.bench.sustained``'s check) no rate where
the start split holds 90% and the candidate does not. The held-out stress set is not run here. Rows of a set are
replaced in ``tests/bench/results/poise_tuning.json`` (others kept); the table is rebuilt from it.
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
from tests.bench.sustained import BISECTIONS, INSTANCES, MODEL, OUT, SEEN, START, TARGET, TUNE

SETS = {"tune": TUNE, "seen": SEEN}


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
    parser.add_argument("--values", default="0.05,0.1,0.15,0.25,0.35")
    parser.add_argument("--sets", default="tune,seen")
    parser.add_argument("--jobs", type=int, default=2)
    args = parser.parse_args()
    values = [float(v) for v in args.values.split(",")]
    workloads = [w for name in args.sets.split(",") for w in SETS[name]]
    command = shlex.join(["python", "-m", "tests.bench.poise_tuning", *sys.argv[1:]])
    with ProcessPoolExecutor(args.jobs) as pool:
        new = list(pool.map(_task, [w for w in workloads for _ in values], [v for _ in workloads for v in values]))
    path = OUT / "poise_tuning.json"
    old = json.loads(path.read_text())["rows"] if path.exists() else []
    rows = [r for r in old if r["workload"] not in workloads] + [{**r, "command": command} for r in new]
    path.write_text(json.dumps({"rows": rows}, indent=1))
    (OUT / "poise_tuning.md").write_text(_table(rows))
    print(_table(rows))


def _table(rows: list[dict[str, Any]]) -> str:
    values = sorted({r["min_gain"] for r in rows})
    names = [w for w in TUNE + SEEN if any(r["workload"] == w for r in rows)]
    cell = {(r["workload"], r["min_gain"]): r for r in rows}
    commands = sorted({r.get("command", "") for r in rows})
    start = {w: _start_goodput(w) for w in SEEN}
    lines = ["# Poise controller: choosing min_gain", "", "Commands: " + ", ".join(f"`{c}`" for c in commands), "",
             "Sustained yardstick (natural time, whole traces, first 120 s not counted, 90% attainment), "
             f"{INSTANCES} instances from {START}. Tune: {', '.join(TUNE)}; seen (validation): {', '.join(SEEN)} "
             f"(start split {START} there: " + ", ".join(f"{w} {g:.2f}x" for w, g in start.items() if g) + ").", "",
             "| min_gain | " + " | ".join(f"{w} ({'tune' if w in TUNE else 'seen'})" for w in names) + " | tune sum |",
             "|---|" + "---|" * len(names) + "---|"]
    for v in values:
        got = [cell.get((w, v)) for w in names]
        tune_sum = sum(r["goodput_scale"] for w, r in zip(names, got, strict=True) if r and w in TUNE)
        lines.append(f"| {v} | " + " | ".join(f"{r['goodput_scale']:.2f}x ({r['flips_at_goodput']} flips)" if r else "-"
                                               for r in got) + f" | {tune_sum:.2f} |")
    return "\n".join(lines) + "\n"


def _start_goodput(workload: str) -> float | None:
    """The start split's goodput from the sustained bench's cache, for the seen set's bar."""
    path = OUT / "sustained" / f"{workload}-all.json"
    try:
        return float(json.loads(path.read_text())[f"static-{START}"]["goodput_scale"])
    except (OSError, KeyError, ValueError):
        return None


if __name__ == "__main__":
    main()
