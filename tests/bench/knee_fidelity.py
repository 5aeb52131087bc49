"""Does the simulator predict the live stack past capacity? One burst, live and simulated, with the stock
engines and with Poise's.

``tests/bench/sim_fidelity.py`` compares latencies where both sides meet every SLO. Goodput is decided near
the knee, where attainment falls: this replays Azure code 780-960 s at 2x (its 840-900 s burst outruns two
prefill engines) through the dev stack (2P2D engine_sim) three times: fixed roles and least-load dispatch with
the engines' stock order (FCFS, chunked), the same with Poise's (FlowPrefill's fewest-late order,
operator-level preemption, whole prompts), and the whole Poise mix (its controller flips an instance during
the burst); and simulates each the same way. The
requests name no SLO class: the gateway gives them its own SLO (``slo_fallback``), as the simulator does.
The bar is sim_fidelity's: attainment within 3 points, TTFT and TPOT percentiles within 10%.
Writes ``tests/bench/results/knee_fidelity.{md,json}``.
"""

from __future__ import annotations

import json
import shlex
import sys
import time
from pathlib import Path
from typing import Any

from loadgen.sim.baselines import make_mix
from loadgen.sim.run import simulate
from loadgen.slo import slo_for
from loadgen.traces import load_trace
from services.cli.stack import Stack, StackSettings
from shared.latency import LatencyModel, load_profile
from shared.policies import POISE_PREFILL_POLICY
from tests.bench.sim_fidelity import METRICS, OUT, compare, error_cell, misses, replay_through

TRACE, START_S, DURATION_S, RATE = "azure-code", 780.0, 180.0, 2.0
#: (label, the stack's settings, the simulated mix and its overrides)
SETUPS: list[tuple[str, dict[str, Any], tuple[str, dict[str, Any]]]] = [
    ("stock engines (FCFS, chunked), fixed roles, least-load", {"planner_policy": "static"}, ("static-minload", {})),
    ("Poise's engines (fewest-late, operator preemption), fixed roles, least-load",
     {"planner_policy": "static", "prefill_policy": POISE_PREFILL_POLICY, "preemption": "operator",
      "chunked_prefill_size": -1},
     ("static-minload", {"prefill_policy": POISE_PREFILL_POLICY, "preemption": "operator", "chunk_tokens": 0})),
    ("the Poise mix (its controller, Arrow's dispatch, its engines)", {"planner_policy": "poise"}, ("poise", {})),
]


def main() -> None:
    command = shlex.join(["python", "-m", "tests.bench.knee_fidelity", *sys.argv[1:]])
    model = LatencyModel(load_profile())
    workload, slo = load_trace(TRACE).slice(START_S, DURATION_S), slo_for(TRACE)
    rows: list[dict[str, Any]] = []
    for label, flags, (mix, overrides) in SETUPS:
        print(f"{label}: {len(workload.requests)} requests of {TRACE} {START_S:g}-{START_S + DURATION_S:g} s "
              f"at {RATE:g}x", file=sys.stderr)
        run = Path(".poise/bench") / f"knee-{time.strftime('%H%M%S')}"
        stack = Stack(StackSettings(gateway_port=0, monitor_port=0, run_dir=run, state_dir=run,
                                    slo_ttft_s=slo.ttft_s, slo_tpot_s=slo.tpot_s, **flags),
                      progress=lambda line: print(line, file=sys.stderr))
        stack.start()
        try:
            live = replay_through(stack, workload, slo, RATE)
        finally:
            stack.stop()
        sim = simulate(workload, make_mix(mix, 4, "2P2D", **overrides), model, slo, rate_scale=RATE)
        row = {"setup": label, "requests": live.summary.requests_total, "live_failed": live.summary.requests_failed,
               **compare(live.summary, sim.summary)}
        row["outside_bar"] = misses(row)
        rows.append(row)
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "knee_fidelity.json").write_text(json.dumps({"command": command, "trace": TRACE,
                                                         "slice_s": [START_S, START_S + DURATION_S],
                                                         "rate_scale": RATE, "rows": rows}, indent=2))
    lines = ["# Simulator fidelity past capacity: one burst, live and simulated", "", f"Command: `{command}`", "",
             f"{TRACE} {START_S:g}-{START_S + DURATION_S:g} s at {RATE:g}x (timestamps divided), 2P2D engine_sim "
             "(llama-3.1-8b-h100) through the dev stack, against `poise sim` of the same mix from 2P2D (static-minload "
             f"with the same engines, or poise); SLO TTFT {slo.ttft_s:g} s, TPOT {slo.tpot_s:g} s. Error = (sim - live) / live; the "
             "bar: 10% on each percentile, 3 points of attainment.", "",
             "| setup | requests | attainment live / sim | TTFT p50 live/sim ms (err) | TTFT p90 | TPOT p50 | "
             "TPOT p90 | outside the bar |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        a = r["attainment"]
        lines.append(f"| {r['setup']} | {r['requests']} | {a['live'] * 100:.1f}% / {a['sim'] * 100:.1f}% | "
                     + " | ".join(error_cell(r[m]) for m in METRICS)
                     + f" | {'; '.join(r['outside_bar']) or 'nothing'} |")
    (OUT / "knee_fidelity.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
