"""DOPD's length-aware prefill batching (``dopd-length``) against FCFS chunked prefill.

Simulated goodput (highest rate, x the trace's, with >= 90% attainment of Arrow's Table 1 SLOs), 8 instances,
Llama-3.1-8B/H100 profile, first 10 minutes of each trace. Where ``dopd-length`` gets its mean input length
(ISL), which sets its long-prompt threshold and packing cap:

- ``mean``: a running mean of the inputs the engine sees (what it does without a planner forecast, and on a
  static 4P4D with least-load dispatch, which has no planner);
- ``forecast``: DOPD's ARIMA one-step forecast, which the control loop of DOPD's own P:D ratio (``dopd-ratio``)
  hands to the engines every 10 s, as the live sidecars relay the planner's forecast events.

Under ``dopd-ratio`` both are run (the relay switched off for ``mean``), so the forecast's own effect is the
difference between the two at the same control plane. Writes ``tests/bench/results/length_batching.{md,json}``.
"""

from __future__ import annotations

import argparse
import functools
import json
import shlex
import sys
import time
from pathlib import Path

from loadgen.sim.baselines import make_mix
from loadgen.sim.control import ControlParams
from loadgen.sim.goodput import search_goodput
from loadgen.slo import slo_for
from loadgen.traces import load_trace
from shared.latency import LatencyModel, load_profile

OUT = Path("tests/bench/results")
TRACES = ["azure-code", "azure-conv", "mooncake-conv"]
# (mix, split, [(prefill policy, where dopd-length's ISL comes from)])
VARIANTS = [
    ("static-minload", "4P4D", [("fcfs", None), ("dopd-length", "mean")]),
    ("dopd-ratio", None, [("fcfs", None), ("dopd-length", "mean"), ("dopd-length", "forecast")]),
]
COLUMNS = [("fcfs", None), ("dopd-length", "mean"), ("dopd-length", "forecast")]


def _cell(by: dict[tuple[str, str | None], float], key: tuple[str, str | None]) -> str:
    return f"{by[key]:.2f}x" if key in by else "-"


def _ratio(by: dict[tuple[str, str | None], float], key: tuple[str, str | None], base: tuple[str, str | None]) -> str:
    return f"{by[key] / by[base]:.2f}" if key in by and by.get(base) else "-"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--traces", nargs="+", default=TRACES, choices=TRACES)
    ap.add_argument("--bisections", type=int, default=5)
    args = ap.parse_args()
    command = shlex.join([Path(sys.executable).name, "-m", "tests.bench.length_batching", *sys.argv[1:]])
    model = LatencyModel(load_profile())
    rows = []
    for trace in args.traces:
        workload = load_trace(trace).slice(0.0, 600.0)
        for mix, split, runs in VARIANTS:
            for policy, isl in runs:
                build = functools.partial(make_mix, mix, 8, split, prefill_policy=policy)
                control = ControlParams(relay_forecast=isl != "mean")
                t0 = time.perf_counter()
                g = search_goodput(workload, build, model, slo_for(trace), bisections=args.bisections, control=control)
                rows.append({"trace": trace, "mix": mix, "prefill_policy": policy, "isl": isl,
                             "goodput_scale": g.goodput_scale})
                print(f"  {trace} {mix} {policy} {isl or ''}: {g.goodput_scale:.2f}x "
                      f"({time.perf_counter() - t0:.0f} s)", file=sys.stderr, flush=True)
    lines = ["# DOPD length-aware prefill batching vs FCFS", "", f"Command: `{command}`", "",
             f"{time.strftime('%Y-%m-%d %H:%M:%S UTC', time.gmtime())}, simulator, 8 instances, "
             "Llama-3.1-8B/H100, first 10 min, Arrow Table 1 SLOs, goodput at 90% attainment (x the trace's rate). "
             "dopd-length's ISL (its long-prompt threshold and packing cap) is either a running mean of the "
             "inputs the engine sees (`mean`) or DOPD's ARIMA forecast relayed to the engines by the control "
             "loop (`forecast`, only where a DOPD planner runs).", "",
             "| trace | mix | fcfs | dopd-length, mean | dopd-length, forecast | mean / fcfs | forecast / fcfs "
             "| forecast / mean |", "|---|---|---|---|---|---|---|---|"]
    for trace in args.traces:
        for mix, _, _ in VARIANTS:
            by = {(r["prefill_policy"], r["isl"]): r["goodput_scale"] for r in rows
                  if r["trace"] == trace and r["mix"] == mix}
            fcfs, mean, fc = COLUMNS
            lines.append(f"| {trace} | {mix} | {_cell(by, fcfs)} | {_cell(by, mean)} | {_cell(by, fc)} "
                         f"| {_ratio(by, mean, fcfs)} | {_ratio(by, fc, fcfs)} | {_ratio(by, fc, mean)} |")
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "length_batching.md").write_text("\n".join(lines) + "\n")
    (OUT / "length_batching.json").write_text(json.dumps({"command": command, "rows": rows}, indent=2))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
