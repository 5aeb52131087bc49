"""Simulator speed: how fast ``poise sim`` replays real traces, and how that scales with cluster size.

Writes ``tests/bench/results/sim_speed.{md,json}`` with the command. Scaling runs replay the Azure
conversation hour with the request rate multiplied by instances / 8, so every size sees the same load per
instance (timestamps divided, so the hour's requests arrive in 60/k minutes). The mix rows run Poise's
controller beside the fixed 4P4D on the same trace and rate at natural time (the sustained yardstick's), at the
trace's rate and at Azure conversation's sustained goodput point (20x), where a goodput search spends its
time: the controller's cost is their ratio, the rest is the load.

``--part data-plane`` (``sim_speed_data_plane.{md,json}``) asks where the time goes when Poise's mix is slowest:
the sustained table's mixes (``tests.bench.sustained.mix_builder``) on five minutes of stress-mix-shift's
long-prompt phase at its goodput point, Poise beside the same split on Poise's engines and gateway, on stock
engines, and colocated serving on Poise's engines.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
import time
from pathlib import Path
from typing import Any

from loadgen.rate_scaling import RateMode
from loadgen.sim.baselines import make_mix
from loadgen.sim.run import simulate
from loadgen.slo import slo_for
from loadgen.traces import load_trace
from shared.latency import LatencyModel, load_profile
from tests.bench.sustained import mix_builder, model_for  # the sustained table's mixes, as it builds them

OUT = Path("tests/bench/results")


def _run(trace: str, instances: int, rate_scale: float, policy: str = "static-minload",
         rate_mode: RateMode = "compress") -> dict[str, Any]:
    workload = load_trace(trace)
    result = simulate(workload, make_mix(policy, instances), LatencyModel(load_profile()), slo_for(trace),
                      rate_scale=rate_scale, rate_mode=rate_mode)
    c = result.config
    row = {"policy": policy, "trace": trace, "instances": instances, "rate_scale": rate_scale, "requests": c["requests"],
           "events": c["events"], "wall_s": c["sim_wall_s"], "simulated_s": result.wall_s,
           "sim_s_per_wall_s": c["sim_seconds_per_wall_second"], "events_per_s": c["events"] / c["sim_wall_s"],
           "attainment": result.summary.slo_attainment}
    print(f"  {policy} {trace} x{rate_scale:g} on {instances}: {row['wall_s']:.1f}s wall, {row['events_per_s']:,.0f} events/s",
          file=sys.stderr)
    return row


#: Stress-mix-shift's long-prompt phase (simulated seconds 900-1200) at Poise's sustained goodput point, where a
#: split serves the prompts (6P2D is its best fixed one); every mix starts empty at 900 s, Poise at 4P4D.
DATA_PLANE_SLICE = ("stress-mix-shift", 900.0, 300.0, 26.0)
DATA_PLANE_MIXES = ("poise", "static-6P2D+poise-engines", "static-6P2D", "colocated+poise-engines")


def _data_plane(command: str) -> None:
    trace, start, duration, scale = DATA_PLANE_SLICE
    workload = load_trace(trace).slice(start, duration)
    rows = []
    for policy in DATA_PLANE_MIXES:
        cpu = time.process_time()
        result = simulate(workload, mix_builder(policy)(), model_for(None), slo_for(trace), rate_scale=scale,
                          rate_mode="natural")
        cpu = time.process_time() - cpu
        rows.append({"policy": policy, "requests": result.config["requests"], "events": result.config["events"],
                     "cpu_s": cpu, "sim_s_per_cpu_s": duration / cpu, "attainment": result.summary.slo_attainment})
        print(f"  {policy}: {cpu:.1f} s CPU", file=sys.stderr)
    doc = {"command": command, "when": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "cpus": os.cpu_count(),
           "slice": {"trace": trace, "start_s": start, "duration_s": duration, "rate_scale": scale}, "rows": rows}
    (OUT / "sim_speed_data_plane.json").write_text(json.dumps(doc, indent=2))
    poise = rows[0]["cpu_s"]
    lines = ["# Simulator speed: Poise's mix against its data plane", "", f"Command: `{command}`", "",
             f"{doc['when']}, {doc['cpus']} cores. {trace}, simulated seconds {start:g}-{start + duration:g} at "
             f"{scale:g}x, natural time, 8 instances (process CPU seconds of one `simulate` each, one after another).",
             "", "| mix | requests | events | CPU s | simulated s per CPU s | CPU / Poise's | SLO attainment |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['policy']} | {r['requests']:,} | {r['events']:,} | {r['cpu_s']:.1f} | "
                     f"{r['sim_s_per_cpu_s']:.0f} | {r['cpu_s'] / poise:.2f} | {r['attainment'] * 100:.1f}% |")
    (OUT / "sim_speed_data_plane.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--part", choices=("all", "data-plane"), default="all",
                        help="all: traces, scaling and Poise beside 4P4D (sim_speed.md); data-plane: Poise beside "
                             "the same split on its data plane (sim_speed_data_plane.md)")
    args = parser.parse_args()
    command = shlex.join([Path(sys.executable).name, "-m", "tests.bench.sim_speed", *sys.argv[1:]])
    OUT.mkdir(parents=True, exist_ok=True)
    if args.part == "data-plane":
        _data_plane(command)
        return
    rows = [_run("azure-conv", 8, 1.0), _run("azure-code", 8, 1.0), _run("mooncake-conv", 8, 1.0)]
    scaling = [_run("azure-conv", n, n / 8) for n in (8, 32, 128)]
    mixes = [(_run(trace, 8, scale, rate_mode="natural"), _run(trace, 8, scale, "poise", "natural"))
             for trace, scale in [("azure-conv", 1.0), ("azure-code", 1.0), ("mooncake-conv", 1.0), ("azure-conv", 20.0)]]
    doc = {"command": command, "when": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "cpus": os.cpu_count(),
           "traces": rows, "scaling": scaling,
           "mixes": [{"static": a, "poise": b} for a, b in mixes]}
    (OUT / "sim_speed.json").write_text(json.dumps(doc, indent=2))
    lines = ["# Simulator speed", "", f"Command: `{command}`", "",
             f"{doc['when']}, {doc['cpus']} cores (the simulator is single-threaded). Policy mix static-minload, "
             "profile llama-3.1-8b-h100, step-level decode.", "",
             "| trace | instances | rate x | requests | events | wall s | simulated s per wall s | events/s | SLO attainment |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rows + scaling:
        lines.append(f"| {r['trace']} | {r['instances']} | {r['rate_scale']:g} | {r['requests']:,} | {r['events']:,} | "
                     f"{r['wall_s']:.1f} | {r['sim_s_per_wall_s']:.0f} | {r['events_per_s']:,.0f} | "
                     f"{r['attainment'] * 100:.1f}% |")
    lines += ["", "Poise's controller beside the fixed 4P4D, same trace and rate at natural time (8 instances):", "",
              "| trace | rate x | requests | 4P4D: simulated s per wall s | poise: simulated s per wall s | "
              "poise wall / 4P4D wall |", "|---|---|---|---|---|---|"]
    for a, b in mixes:
        lines.append(f"| {a['trace']} | {a['rate_scale']:g} | {a['requests']:,} | {a['sim_s_per_wall_s']:.0f} | "
                     f"{b['sim_s_per_wall_s']:.0f} | {b['wall_s'] / a['wall_s']:.2f}x |")
    (OUT / "sim_speed.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
