"""Does the simulator predict real SGLang? A latency profile fitted to SGLang 0.5.23 on this CPU with ``poise
profile``, then the same short trace slices replayed live through Poise onto real engines (1P1D, sglang-cpu
preset) and in the simulator with that profile, side by side.

    python -m tests.bench.sglang_fidelity [--profile PATH]    (~20 min on 2 cores; make sglang-setup first)

Without ``--profile`` it first profiles a colocated engine of the same preset (one core, as each engine of the
live stack gets) and writes the profile to tests/bench/results/profiles/smollm2-135m-cpu.{json,md,png}. Writes
tests/bench/results/sglang_fidelity.{json,md}.

On this hardware the numbers describe a 135M-parameter model on one CPU core per engine, KV moved over TCP on
loopback; what carries over to a GPU node is the method and the gaps' causes, not the values (docs/sglang.md).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import io
import os
import shlex
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from loadgen.progress import ReplayProgress
from loadgen.replay import ReplayResult, replay
from loadgen.sim.baselines import make_mix
from loadgen.sim.overhead import HANDSHAKE_ONLY, HANDSHAKE_S, FirstTokenDelay
from loadgen.sim.run import simulate
from loadgen.slo import SLO
from loadgen.traces import load_trace
from loadgen.workload import Workload
from services.cli.stack import Stack
from services.profiler.cli import cmd_profile
from services.worker.presets import SGLANG_CPU_SLO_S
from shared.latency import LatencyModel, load_profile
from tests.bench.router_compare import cpu_seconds
from tests.bench.sglang_cpu_costs import write_results
from tests.bench.sim_fidelity import METRICS, compare, error_cell, first_token_deltas, misses, scrape_engines
from tests.sglang.realstack import real_stack, serving

REPO = Path(__file__).resolve().parents[2]
RESULTS = REPO / "tests" / "bench" / "results"
PROFILE_OUT = RESULTS / "profiles" / "smollm2-135m-cpu.json"
#: What the profile measures: prompts to 2K tokens (the replayed prompts are capped there), batches to 16.
PROFILE_ARGS = ["--prefill-repeats", "3", "--max-prefill-tokens", "2048", "--batch-sizes", "[1, 4, 16]",
                "--decode-context-tokens", "8192", "--decode-max-prompt", "2048", "--decode-steps", "32",
                "--gpu", "cpu-1-core", "--name", "smollm2-135m-cpu"]
TRACE = "azure-conv"
MAX_INPUT, MAX_OUTPUT = 1024, 32  # what a 135M model on one core answers in seconds, not minutes
CPU_SLO = SLO(*SGLANG_CPU_SLO_S)  # what the pair can meet, as `poise up --engines sglang-cpu` plans for
#: (trace start s, wall duration s, rate scale, role): a light slice, on which the first-token delay of this
#: host is fitted, and one near the pair's capacity (prefill ~65% busy, decode ~70%) that is only reported.
#: A slice of D wall seconds at rate x is D * x seconds of the trace, stretched.
SLICES = [(1200.0, 180.0, 0.025, "light (calibration)"), (1800.0, 180.0, 0.07, "near capacity (held out)")]
LAYOUT = {"p0": "prefill", "d0": "decode"}


def workload_for(start_s: float, duration_s: float, rate: float) -> Workload:
    """The trace's requests that arrive in ``duration_s`` wall seconds from ``start_s`` at ``rate`` times the
    trace's rate, prompts and answers capped (the replay and the simulator both get this workload, so the cap
    is on both sides). Timestamps stay the trace's: the replay and the simulator divide them by ``rate``."""
    return load_trace(TRACE).slice(start_s, duration_s * rate).cap_lengths(MAX_INPUT, MAX_OUTPUT)


def simulate_pair(workload: Workload, model: LatencyModel, rate: float, delay: FirstTokenDelay) -> ReplayResult:
    """The live stack's mix in the simulator: static-minload 1P1D (the gateway's least-load dispatch), no cache
    (the slices' prompts are fresh token ids)."""
    return simulate(workload, make_mix("static-minload", 2, "1P1D"), model, CPU_SLO, rate_scale=rate,
                    first_token_delay=delay)


def _kind(pid: int) -> str | None:
    """Which part of the serving host a process is (None: not part of it)."""
    try:
        comm = Path(f"/proc/{pid}/comm").read_text().strip()
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return None
    if comm.startswith("sglang::schedul"):
        return "engine schedulers (the forward passes)"
    if comm.startswith("sglang::") or "sglang.launch_server" in cmdline:
        return "engine HTTP, tokenizer and detokenizer processes"
    if "services." in cmdline or "nats-server" in cmdline or "etcd" in comm:
        return "Poise control plane (gateway, sidecars, planner, monitor, migrator, NATS, etcd)"
    if pid == os.getpid():
        return "load client"
    return None


def cpu_by_kind() -> dict[str, float]:
    """CPU seconds used so far by every live process of the serving host, summed by :func:`_kind`."""
    out: dict[str, float] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and (kind := _kind(int(entry.name))) is not None:
            with contextlib.suppress(OSError):
                out[kind] = out.get(kind, 0.0) + cpu_seconds(int(entry.name))
    return out


_STAGE_SERIES = {"sglang:per_stage_req_latency_seconds", "sglang:queue_time_seconds"}


def stage_totals(stack: Stack) -> dict[str, tuple[float, float]]:
    """SGLang's own account of where requests spent their time so far: ``<instance>:<stage>`` -> (seconds,
    requests), from each engine's ``sglang:per_stage_req_latency_seconds`` (and ``queue_time_seconds``, the wait
    for a prefill batch)."""
    out: dict[str, tuple[float, float]] = {}
    for instance_id, text in scrape_engines(stack).items():
        for family in text_string_to_metric_families(text):
            if family.name not in _STAGE_SERIES:
                continue
            for sample in family.samples:
                key = f"{instance_id}:{sample.labels.get('stage', 'queue_time')}"
                total, count = out.get(key, (0.0, 0.0))
                if sample.name.endswith("_sum"):
                    out[key] = (total + sample.value, count)
                elif sample.name.endswith("_count"):
                    out[key] = (total, count + sample.value)
    return out


def stage_means(before: dict[str, tuple[float, float]], after: dict[str, tuple[float, float]]) -> dict[str, float]:
    """Mean seconds per request of each stage between two :func:`stage_totals`."""
    out = {}
    for key, (total, count) in sorted(after.items()):
        t0, c0 = before.get(key, (0.0, 0.0))
        if count > c0:
            out[key] = (total - t0) / (count - c0)
    return out


def replay_live(stack: Stack, workload: Workload, rate: float, say: Any) -> ReplayResult:
    def progress(p: ReplayProgress) -> None:
        say(f"  {p.done}/{p.total} done, {p.in_flight} in flight")

    return asyncio.run(replay(workload, stack.gateway_url, model=stack.settings.model, slo=CPU_SLO,
                              rate_scale=rate, api_key=stack.api_key, progress=progress, progress_interval_s=30.0))


def live_and_simulated(profile_path: Path, say: Any) -> dict[str, Any]:
    profile = load_profile(profile_path)
    model = LatencyModel(profile)
    live_runs: list[tuple[Workload, float, ReplayResult, dict[str, Any]]] = []
    with tempfile.TemporaryDirectory() as tmp, real_stack(Path(tmp), prefill=1, decode=1) as stack:
        serving(stack, LAYOUT)
        for start, duration, rate, role in SLICES:
            workload = workload_for(start, duration, rate)
            say(f"{TRACE} from {start:g}s at x{rate:g}: {len(workload)} requests over ~{duration:g}s")
            cpu0, t0, stages0 = cpu_by_kind(), time.monotonic(), stage_totals(stack)
            live = replay_live(stack, workload, rate, say)
            wall = time.monotonic() - t0
            row: dict[str, Any] = {
                "slice_s": [start, duration], "rate_scale": rate, "role": role,
                "requests": live.summary.requests_total, "live_failed": live.summary.requests_failed,
                "cores_used": {k: (v - cpu0.get(k, 0.0)) / wall for k, v in cpu_by_kind().items()},
                "host_cores": os.cpu_count(), "sglang_stage_mean_s": stage_means(stages0, stage_totals(stack))}
            live_runs.append((workload, rate, live, row))
            say(f"  live: {live.summary.requests_ok}/{live.summary.requests_total} ok, TTFT p50 "
                f"{live.summary.ttft_p50_s}, TPOT p50 {live.summary.tpot_p50_s}")
    # Calibrated on the light slice only; the near-capacity slice is reported, not tuned on.
    light_workload, light_rate, light, _ = live_runs[0]
    host = FirstTokenDelay.fit(first_token_deltas(
        light.records, simulate_pair(light_workload, model, light_rate, HANDSHAKE_ONLY).records), handshake_s=HANDSHAKE_S)
    rows = []
    for workload, rate, live, row in live_runs:
        row["model_only"] = compare(live.summary, simulate_pair(workload, model, rate, HANDSHAKE_ONLY).summary)
        row["host_delay"] = compare(live.summary, simulate_pair(workload, model, rate, host).summary)
        rows.append(row)
    return {"rows": rows, "first_token_delay_ms": {"median": host.median_s * 1e3, "p90": host.p90_s * 1e3}}


def profile_engine(say: Any) -> Path:
    """Fit a profile to a colocated engine of the sglang-cpu preset, through ``poise profile``."""
    PROFILE_OUT.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp, real_stack(Path(tmp), prefill=0, decode=0, colocated=1) as stack:
        serving(stack, {"c0": "null"})
        assert stack.credentials is not None
        say(f"profiling {stack.engines['c0']}")
        with contextlib.redirect_stdout(io.StringIO()):  # the report is written next to the profile
            code = cmd_profile(["--engine", stack.engines["c0"], "--out", str(PROFILE_OUT), *PROFILE_ARGS,
                                "--api-key", stack.credentials.engine_api_key or ""])
        if code != 0:
            raise RuntimeError(f"poise profile exited {code}")
    return PROFILE_OUT


def report(data: dict[str, Any]) -> str:
    delay = data["first_token_delay_ms"]
    lines = ["# Simulator fidelity against real SGLang (CPU)", "", f"`{data['command']}`", "",
             f"Live: Poise's gateway (least-load dispatch, static planner) in front of SGLang 0.5.23 on this CPU, "
             f"SmolLM2-135M-Instruct, 1 prefill + 1 decode engine of the sglang-cpu preset (one core each, KV over "
             f"mooncake TCP). Simulated: `poise sim`'s static-minload 1P1D with the profile `{data['profile']}` "
             f"(fitted by `poise profile` on a colocated engine of the same preset). Load: {data['trace']} slices, "
             f"prompts capped at {data['max_input']} tokens and answers at {data['max_output']} (exact, ignore_eos), "
             f"SLO for this CPU TTFT {data['slo']['ttft_s']:g} s, TPOT {data['slo']['tpot_s']:g} s. "
             "Error = (sim - live) / live; the bar: 10% on each percentile, 3 points of attainment.", "",
             "Two simulator columns: the latency model alone (plus the 4-ms handshake), and with this host's "
             f"first-token delay fitted on the light slice (median {delay['median']:.0f} ms, p90 "
             f"{delay['p90']:.0f} ms: the serving path's time outside the engine's forward passes, the KV transfer "
             "included). The delay is fitted on the light slice only; the near-capacity slice is only reported.", "",
             "| slice | rate x | requests | simulator | TTFT p50 live/sim ms (err) | TTFT p90 | TPOT p50 | TPOT p90 "
             "| attainment live/sim | within bar |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in data["rows"]:
        for name, key in (("model only", "model_only"), ("+ host delay", "host_delay")):
            c = r[key]
            a = c["attainment"]
            lines.append(f"| {r['role']}: {r['slice_s'][0]:g} s, {r['slice_s'][1]:g} s wall | {r['rate_scale']:g} | "
                         f"{r['requests']} ({r['live_failed']} failed) | {name} | "
                         + " | ".join(error_cell(c[m]) for m in METRICS)
                         + f" | {a['live'] * 100:.1f}% / {a['sim'] * 100:.1f}% | {'yes' if not misses(c) else 'no'} |")
    lines += ["", "Where the host's cores went during each live slice (CPU seconds / wall seconds, from /proc; the "
              f"host has {data['rows'][0]['host_cores']} cores):", "",
              "| slice | " + " | ".join(kinds := sorted({k for r in data["rows"] for k in r["cores_used"]})) + " |",
              "|---|" + "---|" * len(kinds)]
    for r in data["rows"]:
        lines.append(f"| {r['role']} | " + " | ".join(f"{r['cores_used'].get(k, 0.0):.2f}" for k in kinds) + " |")
    keys = sorted({k for r in data["rows"] for k in r["sglang_stage_mean_s"]})
    lines += ["", "Where a live request's time went, by SGLang's own stage histograms "
              "(`sglang:per_stage_req_latency_seconds`, `queue_time_seconds`; mean ms per request over the slice):", "",
              "| stage | " + " | ".join(r["role"] for r in data["rows"]) + " |", "|---|" + "---:|" * len(data["rows"])]
    for k in keys:
        lines.append(f"| {k} | " + " | ".join(f"{r['sglang_stage_mean_s'].get(k, float('nan')) * 1e3:.0f}"
                                             for r in data["rows"]) + " |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--profile", type=Path, help="a fitted profile to use instead of profiling first")
    args = parser.parse_args()
    command = shlex.join([Path(sys.executable).name, "-m", "tests.bench.sglang_fidelity", *sys.argv[1:]])

    def say(line: str) -> None:
        print(f"[{time.strftime('%H:%M:%S')}] {line}", file=sys.stderr, flush=True)

    path = args.profile or profile_engine(say)
    say(f"profile: {path}")
    data = {"command": command, "profile": str(path.relative_to(REPO) if path.is_relative_to(REPO) else path),
            "trace": TRACE, "max_input": MAX_INPUT, "max_output": MAX_OUTPUT,
            "slo": {"ttft_s": CPU_SLO.ttft_s, "tpot_s": CPU_SLO.tpot_s}, **live_and_simulated(path, say)}
    write_results("sglang_fidelity", data, report(data))


if __name__ == "__main__":
    main()
