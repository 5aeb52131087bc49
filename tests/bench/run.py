"""``make bench``: the control plane's own costs, measured on this machine.

1. Gateway overhead: the same small request sent straight to an engine and through the gateway (which
   routes to that same engine), open-loop Poisson at 100 and 500 req/s, engine_sim at time_scale 0 (no
   compute), so the difference is what the gateway adds. Reported as differences of percentiles
   (unpaired), with the ratio.
2. Gateway throughput: the highest offered rate at which the gateway's added p99 stays within 10 ms.
3. Start-up: seconds from ``poise up`` (installed venv) to the first served token.

Writes ``tests/bench/results/gateway.{md,json,png}`` with the command that produced them.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from services.cli.stack import Stack, StackSettings
from tests.bench.loadclient import Phase, open_loop, percentile

OUT = Path("tests/bench/results")
MODEL = "bench-model"
BODY: dict[str, Any] = {"model": MODEL, "prompt": list(range(16)), "max_tokens": 4, "ignore_eos": True}


def _stats(phase: Phase) -> dict[str, float]:
    return {"p50_ms": percentile(phase.latencies_s, 50) * 1e3, "p99_ms": percentile(phase.latencies_s, 99) * 1e3,
            "ok": len(phase.latencies_s), "errors": phase.errors, "sent": phase.sent,
            "late_p99_ms": percentile(phase.late_s, 99) * 1e3,
            "achieved_rps": len(phase.latencies_s) / phase.wall_s if phase.wall_s else 0.0}


async def _pair(engine_url: str, gateway_url: str, rate: float, duration_s: float) -> dict[str, Any]:
    direct = await open_loop(engine_url + "/v1/completions", BODY, rate_rps=rate, duration_s=duration_s, target="direct")
    via = await open_loop(gateway_url + "/v1/completions", BODY, rate_rps=rate, duration_s=duration_s, target="gateway")
    d, g = _stats(direct), _stats(via)
    print(f"  {rate:g} req/s: direct p50/p99 {d['p50_ms']:.1f}/{d['p99_ms']:.1f} ms, gateway p50/p99 "
          f"{g['p50_ms']:.1f}/{g['p99_ms']:.1f} ms, errors {d['errors']}/{g['errors']}", file=sys.stderr)
    return {"rate_rps": rate, "direct": d, "gateway": g,
            "added_p50_ms": g["p50_ms"] - d["p50_ms"], "added_p99_ms": g["p99_ms"] - d["p99_ms"],
            "ratio_p50": g["p50_ms"] / d["p50_ms"] if d["p50_ms"] else float("nan")}


def bench_gateway(duration_s: float, rates: list[float], sweep: list[float]) -> dict[str, Any]:
    # No API key: the load clients compare the same request sent to the engine and to the gateway unchanged.
    settings = StackSettings(prefill=0, decode=0, colocated=1, time_scale=0.0, model=MODEL, gateway_port=0, auth=False,
                             monitor_port=0, run_dir=(run := Path(".poise/bench") / time.strftime("%Y%m%d-%H%M%S")),
                             state_dir=run)  # its own lock and state: it may run beside `poise up`
    stack = Stack(settings, progress=lambda line: print(line, file=sys.stderr))
    stack.start()
    try:
        engine_url = next(iter(stack.engines.values()))
        overhead = []
        for rate in rates:
            print(f"overhead at {rate:g} req/s ...", file=sys.stderr)
            overhead.append(asyncio.run(_pair(engine_url, stack.gateway_url, rate, duration_s)))
        throughput = []
        best = 0.0
        for rate in sweep:
            print(f"throughput sweep at {rate:g} req/s ...", file=sys.stderr)
            row = asyncio.run(_pair(engine_url, stack.gateway_url, rate, duration_s))
            throughput.append(row)
            if row["added_p99_ms"] <= 10.0 and row["gateway"]["errors"] == 0:
                best = max(best, rate)
            elif row["gateway"]["errors"] or row["added_p99_ms"] > 100:
                break  # far past saturation: higher rates only take longer to say the same
        return {"overhead": overhead, "throughput_sweep": throughput, "max_rate_p99_within_10ms": best}
    finally:
        stack.stop()


def bench_startup() -> dict[str, Any]:
    """Run ``poise up`` as a user would and read when the first token was served."""
    cmd = [str(Path(sys.executable).parent / "poise"), "up", "--gateway-port", "0", "--monitor-port", "0",
           "--run-dir", f".poise/bench/startup-{time.strftime('%Y%m%d-%H%M%S')}"]
    t0 = time.monotonic()
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True)
    first_token_s = None
    assert proc.stderr is not None
    for line in proc.stderr:
        m = re.search(r"first token served ([\d.]+)s after start", line)
        if m:
            first_token_s = float(m.group(1))
            wall = time.monotonic() - t0
            break
    proc.send_signal(signal.SIGINT)
    proc.wait(60)
    return {"first_token_s_reported": first_token_s, "first_token_s_wall": wall if first_token_s else None,
            "command": shlex.join(cmd)}


def _plot(result: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["gateway"]["overhead"] + result["gateway"]["throughput_sweep"]
    rows = sorted({r["rate_rps"]: r for r in rows}.values(), key=lambda r: r["rate_rps"])
    rates = [r["rate_rps"] for r in rows]
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(rates, [r["added_p50_ms"] for r in rows], "o-", label="added p50")
    ax.plot(rates, [r["added_p99_ms"] for r in rows], "s-", label="added p99")
    ax.axhline(10, color="gray", ls="--", label="10 ms budget")
    ax.set_xlabel("offered load (req/s)")
    ax.set_ylabel("gateway latency added (ms)")
    ax.set_title("Poise gateway overhead vs direct engine (engine_sim, no compute)")
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _markdown(result: dict[str, Any], command: str) -> str:
    lines = ["# Gateway benchmark", "", f"Command: `{command}`", "",
             f"Machine: {os.cpu_count()} cores; {result['when']}. engine_sim at time_scale 0 (no compute); request: "
             "16-token prompt, 4 output tokens, non-streaming. Added = gateway percentile minus direct percentile.", "",
             "| offered req/s | direct p50 ms | direct p99 ms | gateway p50 ms | gateway p99 ms | added p50 ms | added p99 ms | gateway/direct p50 | errors |",
             "|---|---|---|---|---|---|---|---|---|"]
    g = result["gateway"]
    for r in g["overhead"] + g["throughput_sweep"]:
        lines.append(f"| {r['rate_rps']:g} | {r['direct']['p50_ms']:.2f} | {r['direct']['p99_ms']:.2f} | "
                     f"{r['gateway']['p50_ms']:.2f} | {r['gateway']['p99_ms']:.2f} | {r['added_p50_ms']:.2f} | "
                     f"{r['added_p99_ms']:.2f} | {r['ratio_p50']:.2f}x | {r['gateway']['errors']} |")
    lines += ["", f"Highest offered rate with added p99 <= 10 ms: **{g['max_rate_p99_within_10ms']:g} req/s**"]
    s = result.get("startup")
    if s:
        lines += ["", f"Start-up: `{s['command']}` served its first token after **{s['first_token_s_reported']}** s."]
    return "\n".join(lines) + "\n"


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt  # so the stack's finally blocks stop every process it started


def main() -> None:
    signal.signal(signal.SIGTERM, _interrupt)
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--duration-s", type=float, default=20.0, help="seconds per (target, rate) phase")
    parser.add_argument("--rates", default="100,500", help="overhead rates, req/s")
    parser.add_argument("--sweep", default="600,800,1000,1200", help="throughput sweep rates, req/s")
    parser.add_argument("--skip-startup", action="store_true")
    args = parser.parse_args()
    command = shlex.join([Path(sys.executable).name, "-m", "tests.bench.run", *sys.argv[1:]])
    result: dict[str, Any] = {"command": command, "when": time.strftime("%Y-%m-%d %H:%M:%S %Z")}
    result["gateway"] = bench_gateway(args.duration_s, [float(r) for r in args.rates.split(",")],
                                      [float(r) for r in args.sweep.split(",") if r])
    if not args.skip_startup:
        result["startup"] = bench_startup()
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "gateway.json").write_text(json.dumps(result, indent=2))
    (OUT / "gateway.md").write_text(_markdown(result, command))
    _plot(result, OUT / "gateway.png")
    print((OUT / "gateway.md").read_text())


if __name__ == "__main__":
    main()
