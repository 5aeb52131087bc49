"""Choosing a Poise controller parameter (``--param``, a ``PoiseParams`` field: ``min_gain``, ``kv_sd``):
goodput per candidate value on the tune set, then on the seen set.

The sustained yardstick (``loadgen.sim.goodput`` defaults, 8 instances, starting at 4P4D) for each value of
``--values`` on ``--sets``: ``tune`` (the two Azure 2023 traces, ``TUNE`` of ``tests.bench.sustained``) and
``seen`` (``SEEN``: a validation set, used to check a candidate, never to fit one). The rule
(docs/evaluation.md): the largest value with the best tune-set goodput sum among those that hold up on the
seen set: goodput not below the best fixed split's, and (``tests.bench.sustained``'s check) no rate where the
start split holds 90% and the candidate does not. The held-out stress set is not run here. The default
value's row is the sustained bench's ``poise`` search (``tests/bench/results/sustained/``), the same search
with every parameter at its default. Rows of a (parameter, workload) are replaced in
``tests/bench/results/poise_tuning.json`` (others kept); the tables are rebuilt from it.
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

import msgspec

from loadgen.sim.baselines import PolicyMix, make_mix
from loadgen.sim.goodput import GoodputResult, search_goodput
from loadgen.slo import slo_for
from loadgen.traces import load_trace
from shared.latency import LatencyModel
from shared.policies.context import PolicyContext
from shared.policies.poise import PoiseParams, PoisePools
from tests.bench.sustained import BISECTIONS, INSTANCES, MODEL, OUT, SEEN, START, TARGET, TUNE, load_results

SETS = {"tune": TUNE, "seen": SEEN}


def _mix(param: str, value: float) -> PolicyMix:
    mix = make_mix("poise", INSTANCES, START)
    base = mix.bind
    assert base is not None
    params = msgspec.convert({param: value}, PoiseParams)

    def bind(model: LatencyModel, ctx: PolicyContext) -> dict[str, Any]:
        return {**base(model, ctx), "pools": PoisePools(model, ctx, params)}

    return dataclasses.replace(mix, bind=bind)


def _row(workload: str, param: str, value: float, result: GoodputResult) -> dict[str, Any]:
    at = max((p for p in result.points if p.rate_scale <= result.goodput_scale), key=lambda p: p.rate_scale,
             default=None)
    return {"param": param, "value": value, "workload": workload, "goodput_scale": result.goodput_scale,
            "non_monotone": result.non_monotone, "flips_at_goodput": at.flips if at else None,
            "max_flips_per_instance_5min": max((p.max_flips_per_instance_5min for p in result.points), default=0)}


def _task(workload: str, param: str, value: float) -> dict[str, Any]:
    t0 = time.monotonic()
    result = search_goodput(load_trace(workload), functools.partial(_mix, param, value), MODEL, slo_for(workload),
                            target=TARGET, bisections=BISECTIONS, probe_above=1)
    print(f"  {workload} {param}={value}: {result.goodput_scale:.2f}x ({time.monotonic() - t0:.0f} s)",
          file=sys.stderr, flush=True)
    return _row(workload, param, value, result)


def _default_rows(param: str, workloads: list[str]) -> list[dict[str, Any]]:
    """The default value's rows, from the sustained bench's cached ``poise`` searches."""
    value = getattr(PoiseParams(), param)
    rows = []
    for w in workloads:
        poise = load_results(OUT / "sustained" / f"{w}-all.json").get("poise")
        if poise is not None:
            rows.append({**_row(w, param, value, poise), "command": "python -m tests.bench.sustained (poise)"})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--param", default="min_gain", choices=[f for f in PoiseParams.__struct_fields__
                                                                  if isinstance(getattr(PoiseParams(), f), float)])
    parser.add_argument("--values", default="0.1,0.25,0.4", help="candidates besides the default")
    parser.add_argument("--sets", default="tune,seen")
    parser.add_argument("--jobs", type=int, default=2)
    args = parser.parse_args()
    default = getattr(PoiseParams(), args.param)
    values = [v for v in (float(x) for x in args.values.split(",")) if v != default]
    workloads = [w for name in args.sets.split(",") for w in SETS[name]]
    command = shlex.join(["python", "-m", "tests.bench.poise_tuning", *sys.argv[1:]])
    with ProcessPoolExecutor(args.jobs) as pool:
        new = list(pool.map(_task, [w for w in workloads for _ in values], [args.param] * len(workloads) * len(values),
                            [v for _ in workloads for v in values]))
    path = OUT / "poise_tuning.json"
    old = json.loads(path.read_text())["rows"] if path.exists() else []
    replaced = {(args.param, w) for w in workloads}
    rows = ([r for r in old if (r["param"], r["workload"]) not in replaced]
            + [{**r, "command": command} for r in new] + _default_rows(args.param, workloads))
    path.write_text(json.dumps({"rows": rows}, indent=1))
    (OUT / "poise_tuning.md").write_text(_tables(rows))
    print(_tables(rows))


def _tables(rows: list[dict[str, Any]]) -> str:
    commands = sorted({r.get("command", "") for r in rows})
    start = {w: _start_goodput(w) for w in SEEN}
    lines = ["# Poise controller: choosing its parameters", "", "Commands: " + ", ".join(f"`{c}`" for c in commands),
             "", "Sustained yardstick (natural time, whole traces, first 120 s not counted, 90% attainment), "
             f"{INSTANCES} instances from {START}, every other parameter at its default (the default value's row "
             f"is the sustained table's poise search). Tune: {', '.join(TUNE)}; seen (validation): "
             f"{', '.join(SEEN)} (start split {START} there: "
             + ", ".join(f"{w} {g:.2f}x" for w, g in start.items() if g) + ")."]
    for param in sorted({r["param"] for r in rows}):
        mine = [r for r in rows if r["param"] == param]
        default = getattr(PoiseParams(), param)
        names = [w for w in TUNE + SEEN if any(r["workload"] == w for r in mine)]
        cell = {(r["workload"], r["value"]): r for r in mine}
        lines += ["", f"## {param} (default {default:g})", "",
                  f"| {param} | " + " | ".join(f"{w} ({'tune' if w in TUNE else 'seen'})" for w in names)
                  + " | tune sum |", "|---|" + "---|" * len(names) + "---|"]
        for v in sorted({r["value"] for r in mine}):
            got = [cell.get((w, v)) for w in names]
            tune_sum = sum(r["goodput_scale"] for w, r in zip(names, got, strict=True) if r and w in TUNE)
            lines.append(f"| {v:g} | " + " | ".join(
                f"{r['goodput_scale']:.2f}x ({r['flips_at_goodput']} flips at it)" if r else "-" for r in got)
                + f" | {tune_sum:.2f} |")
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
