"""DOPD against Dynamo's two planners on load that rises and falls (DOPD's dynamic experiment, Fig. 10).

Each Azure trace (the whole hour) is time-warped onto one day-shaped cycle (``loadgen/dayshape.py``: the
rate goes from 0.2x to 1x of the trace's and back) and replayed at a rate scale that makes its peak need most
of 8 GPUs. The elastic mixes (``dopd``, ``dynamo-load``, ``dynamo-sla``) start at 1P1D on a budget of 8
GPUs, like DOPD's experiment; ``static-minload`` 4P4D holds all 8 the whole time, for reference. Reported:
SLO attainment (Arrow Table 1 SLOs), P90 TTFT/TPOT, GPU-seconds and the mean GPUs they amount to, and per
trace a PNG of provisioned instances against the request rate over time, one panel per policy.

Writes ``tests/bench/results/dopd_vs_dynamo.{md,json}`` and ``dopd_vs_dynamo-<trace>.png``.
"""

from __future__ import annotations

import json
import shlex
import sys
import time
from pathlib import Path
from typing import Any

from loadgen.dayshape import day_shape
from loadgen.replay import ReplayResult
from loadgen.sim.baselines import make_mix
from loadgen.sim.run import simulate
from loadgen.slo import slo_for
from loadgen.traces import load_trace
from loadgen.workload import Workload
from shared.latency import LatencyModel, load_profile

OUT = Path("tests/bench/results")
RUNS = [("azure-conv", 8.0), ("azure-code", 5.0)]  # rate scales: the peak needs most of 8 GPUs
POLICIES = [("dopd", "1P1D"), ("dynamo-load", "1P1D"), ("dynamo-sla", "1P1D"), ("static-minload", None)]


def day_workload(trace: str) -> Workload:
    """The whole trace time-warped onto one day-shaped cycle, 0.2x to 1x of its rate (shared with
    tests/bench/local_prefill.py, which runs elastic DOPD on the same load)."""
    base = load_trace(trace)
    return day_shape(base, period_s=base.duration_s / 0.6, low=0.2, high=1.0)


def _plot(trace: str, results: list[tuple[str, ReplayResult]], path: Path, bin_s: float = 30.0) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(results), 1, figsize=(10, 2.4 * len(results)), sharex=True)
    for ax, (name, result) in zip(axes, results, strict=True):
        end = result.wall_s
        bins = int(end // bin_s) + 1
        counts = [0] * bins
        for r in result.records:
            counts[min(int(r.arrival_s // bin_s), bins - 1)] += 1
        lc = result.config["lifecycle"]
        steps = [*lc["timeline"], [end, *lc["timeline"][-1][1:]]]
        ax.step([s[0] for s in steps], [s[1] + s[2] for s in steps], where="post", color="black", label="GPUs")
        ax.step([s[0] for s in steps], [s[1] for s in steps], where="post", lw=1, label="prefill")
        ax.step([s[0] for s in steps], [s[2] for s in steps], where="post", lw=1, label="decode")
        ax.set_ylim(0, 9)
        ax.set_ylabel("instances")
        rate = ax.twinx()
        rate.plot([i * bin_s for i in range(bins)], [c / bin_s for c in counts], color="gray", alpha=0.5)
        rate.set_ylabel("req/s", color="gray")
        ax.set_title(f"{name}: attainment {result.summary.slo_attainment:.1%}, "
                     f"{lc['gpu_seconds'] / end:.2f} GPUs on average", fontsize=9)
        ax.grid(alpha=0.3)
    axes[0].legend(loc="upper left", fontsize=8)
    axes[-1].set_xlabel("simulated time (s)")
    fig.suptitle(f"{trace}, day-shaped: provisioned instances (left) and request rate (grey, right)")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main() -> None:
    command = shlex.join([Path(sys.executable).name, "-m", "tests.bench.dopd_vs_dynamo", *sys.argv[1:]])
    model = LatencyModel(load_profile())
    rows: list[dict[str, Any]] = []
    for trace, scale in RUNS:
        workload = day_workload(trace)
        slo = slo_for(trace)
        results = []
        for name, split in POLICIES:
            t0 = time.perf_counter()
            result = simulate(workload, make_mix(name, 8, split), model, slo, rate_scale=scale)
            lc = result.config["lifecycle"]
            s = result.summary
            row = {"trace": trace, "rate_scale": scale, "policy": name, "requests": s.requests_total,
                   "attainment": s.slo_attainment, "ttft_p90_s": s.ttft_p90_s, "tpot_p90_s": s.tpot_p90_s,
                   "gpu_seconds": lc["gpu_seconds"], "mean_gpus": lc["gpu_seconds"] / s.wall_s,
                   "starts": lc["starts"], "stops": lc["stops"], "makespan_s": s.wall_s,
                   "sim_wall_s": time.perf_counter() - t0}
            rows.append(row)
            results.append((name, result))
            print(f"  {trace} {name}: attainment {s.slo_attainment:.1%}, {row['mean_gpus']:.2f} GPUs, "
                  f"{row['sim_wall_s']:.1f}s", file=sys.stderr, flush=True)
        _plot(trace, results, OUT / f"dopd_vs_dynamo-{trace}.png")
    lines = ["# DOPD vs Dynamo's planners on day-shaped load", "", f"Command: `{command}`", "",
             f"{time.strftime('%Y-%m-%d %H:%M:%S UTC', time.gmtime())}, simulator, 8-GPU budget, Llama-3.1-8B/H100 "
             "profile, replica start 30 s. Elastic mixes start at 1P1D; static-minload holds 4P4D throughout.", "",
             "| trace | rate x | policy | SLO attainment | P90 TTFT s | P90 TPOT ms | GPU-seconds | mean GPUs | starts / stops |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['trace']} | {r['rate_scale']:g} | {r['policy']} | {r['attainment']:.1%} | "
                     f"{r['ttft_p90_s']:.2f} | {r['tpot_p90_s'] * 1e3:.0f} | {r['gpu_seconds']:,.0f} | "
                     f"{r['mean_gpus']:.2f} | {r['starts']} / {r['stops']} |")
    lines += ["", "Plots: " + ", ".join(f"`dopd_vs_dynamo-{t}.png`" for t, _ in RUNS)]
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "dopd_vs_dynamo.md").write_text("\n".join(lines) + "\n")
    (OUT / "dopd_vs_dynamo.json").write_text(json.dumps({"command": command, "rows": rows}, indent=2))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
