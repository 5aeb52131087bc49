"""Kairos (urgency-ordered prefill, slack-guided decode batching) against FCFS + continuous batching.

Simulated, 8 instances (4P4D, least-load dispatch, DistServe-like), Llama-3.1-8B/H100 profile, the first 10
minutes of Mooncake conversation (long-tailed prompts, like Kairos' Online-GLM trace), Kairos' SLOs (TTFT 8 s,
TPOT 50 ms) and a second run at a tighter TPOT (25 ms), where the 8B model's decode steps come closer to
the target. At each rate (a multiple of the trace's): TTFT, TPOT and end-to-end attainment and the median
per-request decode throughput (output tokens after the first over the time from first to last token).

Mixes: ``fcfs`` (FCFS prefill in 8192-token chunks, continuous batching: DistServe), ``kairos`` (Algorithms
1-3: urgency-ordered chunks, slack-guided decode batches), and the halves ``kairos-prefill`` and
``kairos-decode``, ``kairos-literal`` (the paper's literal urgency sort, see shared/policies/kairos.py),
``kairos-paper`` (literal sort and Algorithm 3 as written: solo-step slack reserve, KV waiters ignored) and
``poise``, the composed default (Arrow + DOPD flips, FlowPrefill engines, continuous decode).

Writes ``tests/bench/results/kairos.{md,json,png}``.
"""

from __future__ import annotations

import json
import shlex
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from loadgen.replay import ReplayResult
from loadgen.sim.baselines import make_mix
from loadgen.sim.run import simulate
from loadgen.slo import SLO
from loadgen.traces import load_trace
from shared.latency import LatencyModel, load_profile

OUT = Path("tests/bench/results")
TRACE = "mooncake-conv"
SLOS = {"kairos-slo": SLO(ttft_s=8.0, tpot_s=0.05), "tight-tpot": SLO(ttft_s=8.0, tpot_s=0.025)}
SCALES = [0.5, 1.0, 1.5, 2.0, 2.5, 3.0, 3.5]
MIXES: dict[str, dict[str, str]] = {  # engine settings; "mix": a mix other than static-minload
    "fcfs": {"prefill_policy": "fcfs", "decode_policy": "continuous"},
    "kairos-prefill": {"prefill_policy": "kairos", "decode_policy": "continuous"},
    "kairos-decode": {"prefill_policy": "fcfs", "decode_policy": "kairos-slack"},
    "kairos": {"prefill_policy": "kairos", "decode_policy": "kairos-slack"},
    "kairos-literal": {"prefill_policy": "kairos-literal", "decode_policy": "kairos-slack"},
    "kairos-paper": {"prefill_policy": "kairos-literal", "decode_policy": "kairos-slack-paper"},
    "poise": {"mix": "poise"},
}


def decode_tps_median(result: ReplayResult) -> float | None:
    rates = [(r.output_tokens_received - 1) / (r.finished_s - r.first_token_s) for r in result.records
             if r.ok and r.first_token_s is not None and r.output_tokens_received > 1 and r.finished_s > r.first_token_s]
    return statistics.median(rates) if rates else None


def run_point(workload: Any, mix_name: str, slo: SLO, scale: float, model: LatencyModel) -> dict[str, Any]:
    """One simulated run of ``MIXES[mix_name]`` at ``scale`` x the trace's rate: attainment and decode speed."""
    t0 = time.perf_counter()
    kwargs: dict[str, Any] = dict(MIXES[mix_name])
    mix = make_mix(kwargs.pop("mix", "static-minload"), 8, "4P4D", **kwargs)
    r = simulate(workload, mix, model, slo, rate_scale=scale)
    s = r.summary
    return {"mix": mix_name, "rate_scale": scale, "rate_rps": workload.mean_rate_rps * scale,
            "ttft_attainment": s.ttft_attainment, "tpot_attainment": s.tpot_attainment,
            "e2e_attainment": s.slo_attainment, "decode_tps_median": decode_tps_median(r),
            "ttft_p90_s": s.ttft_p90_s, "tpot_p90_s": s.tpot_p90_s, "sim_wall_s": time.perf_counter() - t0}


TABLE_HEAD = ["| rate x | req/s | mix | TTFT att. | TPOT att. | E2E att. | E2E vs fcfs (points) | median decode tok/s "
              "| vs fcfs |", "|---|---|---|---|---|---|---|---|---|"]


def table_row(r: dict[str, Any], base: dict[str, Any]) -> str:
    """One mix at one rate, against ``base`` (fcfs at the same rate)."""
    tps, btps = r["decode_tps_median"], base["decode_tps_median"]
    gain = f"{tps / btps - 1:+.1%}" if tps and btps else "-"
    return (f"| {r['rate_scale']:g} | {r['rate_rps']:.2f} | {r['mix']} | {r['ttft_attainment']:.1%} | "
            f"{r['tpot_attainment']:.1%} | {r['e2e_attainment']:.1%} | "
            f"{(r['e2e_attainment'] - base['e2e_attainment']) * 100:+.1f} | "
            f"{'-' if tps is None else f'{tps:.1f}'} | {gain} |")


def write_results(name: str, lines: list[str], rows: list[dict[str, Any]], command: str,
                  plot: Any) -> None:
    """``<name>.md`` (``lines``), ``<name>.json`` (the rows and the command) and ``<name>.png`` in OUT."""
    lines.append(f"Plot: `{name}.png`")
    OUT.mkdir(parents=True, exist_ok=True)
    plot(rows, OUT / f"{name}.png")
    (OUT / f"{name}.md").write_text("\n".join(lines) + "\n")
    (OUT / f"{name}.json").write_text(json.dumps({"command": command, "rows": rows}, indent=2))
    print("\n".join(lines))


def _plot(rows: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    slos = list(SLOS)
    metrics = [("ttft_attainment", "TTFT attainment"), ("tpot_attainment", "TPOT attainment"),
               ("e2e_attainment", "E2E attainment"), ("decode_tps_median", "median decode tok/s per request")]
    fig, axes = plt.subplots(len(slos), len(metrics), figsize=(4 * len(metrics), 3.2 * len(slos)), squeeze=False)
    for i, slo in enumerate(slos):
        for j, (key, label) in enumerate(metrics):
            ax = axes[i][j]
            for mix in MIXES:
                pts = [r for r in rows if r["slo"] == slo and r["mix"] == mix]
                ax.plot([p["rate_rps"] for p in pts], [p[key] for p in pts], marker=".", label=mix)
            ax.set_title(f"{slo}: {label}", fontsize=9)
            ax.set_xlabel("req/s")
            ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main() -> None:
    command = shlex.join([Path(sys.executable).name, "-m", "tests.bench.kairos", *sys.argv[1:]])
    model = LatencyModel(load_profile())
    workload = load_trace(TRACE).slice(0.0, 600.0)
    rows: list[dict[str, Any]] = []
    for slo_name, slo in SLOS.items():
        for mix_name in MIXES:
            for scale in SCALES:
                row = {"slo": slo_name, **run_point(workload, mix_name, slo, scale, model)}
                rows.append(row)
                print(f"  {slo_name} {mix_name} {scale}x: e2e {row['e2e_attainment']:.1%} "
                      f"({row['sim_wall_s']:.1f}s)", file=sys.stderr, flush=True)
    lines = ["# Kairos vs FCFS + continuous batching (Mooncake conversation)", "", f"Command: `{command}`", "",
             f"{time.strftime('%Y-%m-%d %H:%M:%S UTC', time.gmtime())}, simulator, 4P4D least-load, "
             "Llama-3.1-8B/H100 profile, first 10 min of the trace. Attainment in %; points = percentage points "
             "over fcfs at the same rate.", ""]
    for slo_name, slo in SLOS.items():
        lines += [f"## {slo_name}: TTFT {slo.ttft_s:g} s, TPOT {slo.tpot_s * 1e3:g} ms", "",
                  *TABLE_HEAD]
        for scale in SCALES:
            base = next(r for r in rows if r["slo"] == slo_name and r["mix"] == "fcfs" and r["rate_scale"] == scale)
            lines += [table_row(r, base) for r in rows if r["slo"] == slo_name and r["rate_scale"] == scale]
        lines.append("")
    write_results("kairos", lines, rows, command, _plot)


if __name__ == "__main__":
    main()
