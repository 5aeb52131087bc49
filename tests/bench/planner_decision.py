"""What one decision of the Poise pool policy costs: ``PoisePools.decide`` timed on every snapshot of a whole
simulated hour (Azure conversation at natural time, 8 instances), and the simulation's own speed with it.

The live planner runs the same call in its decider thread (services/planner/decider.py, whose ``p99_ms`` the
planner's status reports); the goal is a p99 under 200 ms. Writes ``tests/bench/results/planner_decision.md``.
"""

from __future__ import annotations

import dataclasses
import shlex
import sys
import time
from pathlib import Path

from loadgen.sim.baselines import make_mix
from loadgen.sim.run import simulate
from loadgen.slo import slo_for
from loadgen.traces import load_trace
from services.planner.decider import quantile
from shared.latency import LatencyModel, load_profile

OUT = Path("tests/bench/results/planner_decision.md")


def main() -> None:
    rows = []
    for trace, scale in (("azure-conv", 4.0), ("azure-code", 4.0), ("mooncake-conv", 1.0)):
        times: list[float] = []
        mix = make_mix("poise", 8, "4P4D")
        model = LatencyModel(load_profile())
        bound = mix.bind
        assert bound is not None

        def timed_bind(m: LatencyModel, ctx: object, bound: object = bound, times: list[float] = times) -> dict[str, object]:
            out = bound(m, ctx)  # type: ignore[operator]
            pools = out["pools"]
            decide = pools.decide

            def wrapped(snapshot: object, now_s: float) -> object:
                t0 = time.perf_counter()
                try:
                    return decide(snapshot, now_s)
                finally:
                    times.append(time.perf_counter() - t0)

            pools.decide = wrapped
            return out

        mix = dataclasses.replace(mix, bind=timed_bind)
        result = simulate(load_trace(trace), mix, model, slo_for(trace), rate_scale=scale, rate_mode="natural",
                          warmup_s=120.0)
        times.sort()
        rows.append((trace, scale, len(times), quantile(times, 0.5) * 1e3, quantile(times, 0.99) * 1e3,
                     times[-1] * 1e3, result.config["sim_seconds_per_wall_second"]))
        print(rows[-1], file=sys.stderr, flush=True)
    command = shlex.join(["python", "-m", "tests.bench.planner_decision", *sys.argv[1:]])
    lines = ["# Poise pool policy: cost of one decision", "", f"Command: `{command}`", "",
             "| trace | rate (natural) | decisions | p50 (ms) | p99 (ms) | max (ms) | simulated s per wall s |",
             "|---|---|---|---|---|---|---|"]
    lines += [f"| {t} | {s:g}x | {n} | {p50:.3f} | {p99:.3f} | {mx:.3f} | {speed:.0f} |"
              for t, s, n, p50, p99, mx, speed in rows]
    OUT.write_text("\n".join(lines) + "\n")
    print(OUT.read_text())


if __name__ == "__main__":
    main()
