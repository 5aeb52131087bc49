"""SGLang's own router beside Poise's gateway, in front of the same real SGLang engines (CPU, SmolLM2-135M-Instruct:
one prefill, two decode). SGLang's router is `smg` 1.13 with ``--pd-disaggregation``, ``cache_aware`` prefill and
``power_of_two`` decode (its PD defaults in SGLang's docs); Poise's gateway runs its default dispatch for stock
engines (least-load) with no planner moves (static). Both get the same open-loop replay from Poise's load client:
the first requests of Azure conversation with their arrival times, prompts and outputs capped to what this CPU
serves in a few minutes, at a light and a near-capacity rate.

On this hardware the numbers compare routers (their placement and their own overhead), not GPUs: every engine is
a CPU core running a 135M model at ~16 tokens/s a stream.

    python -m tests.bench.sglang_router_compare [--requests 40] [--rates 0.5,2]   (~8 min; make sglang-setup)

Writes tests/bench/results/sglang_router_compare.{json,md}."""

from __future__ import annotations

import argparse
import asyncio
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

from loadgen.replay import replay
from loadgen.slo import SLO
from loadgen.traces import load_trace
from loadgen.workload import TraceRequest, Workload
from services.worker.presets import sglang_cpu_venv
from shared.devservers import free_port
from tests.bench.sglang_cpu_costs import write_results
from tests.sglang.realstack import MODEL, real_stack, until

TRACE = "azure-conv"
MAX_INPUT, MAX_OUTPUT = 512, 48
VOCAB = 49152  # SmolLM2's: the load client's token-id prompts must stay inside it
# What a 135M model on one CPU core can meet: a 512-token prompt prefills in ~0.5-1 s here, a stream runs at
# ~16 tokens/s alone (about 0.06 s a token); both routers are judged by the same bar.
CPU_SLO = SLO(ttft_s=3.0, tpot_s=0.25)


def workload(n: int) -> Workload:
    trace = load_trace(TRACE)
    requests = [TraceRequest(index=r.index, arrival_s=r.arrival_s - trace.requests[0].arrival_s,
                             input_tokens=min(r.input_tokens, MAX_INPUT), output_tokens=min(r.output_tokens, MAX_OUTPUT))
                for r in trace.requests[:n]]
    return Workload(name=TRACE, requests=requests)


def start_smg(engines: dict[str, str], bootstrap: dict[str, int], log: Path) -> tuple[subprocess.Popen[bytes], str]:
    port = free_port("127.0.0.1")
    cmd = [str(sglang_cpu_venv() / "bin" / "python"), "-m", "smg.launch_router", "--pd-disaggregation",
           "--prefill", engines["p0"], str(bootstrap["p0"]), "--decode", engines["d0"], "--decode", engines["d1"],
           "--prefill-policy", "cache_aware", "--decode-policy", "power_of_two",
           "--host", "127.0.0.1", "--port", str(port), "--prometheus-host", "127.0.0.1",
           "--prometheus-port", str(free_port("127.0.0.1"))]
    with log.open("wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"

    def up() -> bool:
        if proc.poll() is not None:
            raise RuntimeError(f"smg exited with {proc.returncode}: {log.read_text()[-2000:]}")
        try:
            return httpx.get(url + "/v1/models", timeout=2, trust_env=False).status_code == 200
        except httpx.HTTPError:
            return False

    until(up, 120, "smg serving")
    return proc, url


def run_one(url: str, load: Workload, rate: float, api_key: str | None) -> dict[str, Any]:
    scale = rate / load.mean_rate_rps if load.mean_rate_rps > 0 else 1.0
    result = asyncio.run(replay(load, url, model=MODEL, rate_scale=scale, slo=CPU_SLO, api_key=api_key,
                                timeout_s=600, vocab_size=VOCAB, send_slo=False, keep_token_times=False))
    s = result.summary
    return {"rate_rps": rate, "requests": s.requests_total, "ok": s.requests_ok, "failed": s.requests_failed,
            "ttft_p50_s": s.ttft_p50_s, "ttft_p90_s": s.ttft_p90_s, "tpot_p50_s": s.tpot_p50_s,
            "tpot_p90_s": s.tpot_p90_s, "attainment": s.slo_attainment, "output_tokens_per_s": s.output_tokens_per_s,
            "wall_s": s.wall_s}


def measure(n: int, rates: list[float], say: Any) -> dict[str, Any]:
    load = workload(n)
    out: dict[str, Any] = {"requests": n, "rates_rps": rates, "trace": TRACE, "max_input": MAX_INPUT,
                           "max_output": MAX_OUTPUT, "slo": {"ttft_s": CPU_SLO.ttft_s, "tpot_s": CPU_SLO.tpot_s},
                           "runs": []}
    with tempfile.TemporaryDirectory() as tmp, \
            real_stack(Path(tmp), prefill=1, decode=2, auth=False) as stack:
        proc, smg_url = start_smg(stack.engines, stack.bootstrap_ports, Path(tmp) / "smg.log")
        try:
            for rate in rates:
                for router, url in (("poise", stack.gateway_url), ("smg", smg_url)):
                    t0 = time.monotonic()
                    row = {"router": router, **run_one(url, load, rate, None)}
                    out["runs"].append(row)
                    say(f"{router} at {rate:g} req/s: {row['ok']}/{row['requests']} ok, attainment "
                        f"{row['attainment']:.1%}, TTFT p50 {row['ttft_p50_s']}, ({time.monotonic() - t0:.0f}s)")
        finally:
            proc.terminate()
            proc.wait(15)
    return out


def _ms(v: float | None) -> str:
    return "-" if v is None else f"{v * 1000:.0f}"


def report(data: dict[str, Any], command: str) -> str:
    lines = ["# SGLang's router (smg) beside Poise's gateway, on the same real SGLang engines (CPU)", "",
             f"`{command}` — SGLang 0.5.23 on this CPU, SmolLM2-135M-Instruct, 1 prefill + 2 decode engines "
             f"(sglang-cpu preset) on a 2-core machine. Load: the first {data['requests']} requests of "
             f"{data['trace']} at their arrival times rescaled to each rate, prompts capped at {data['max_input']} "
             f"tokens and outputs at {data['max_output']} (exact, ignore_eos), streamed; SLO for this CPU TTFT "
             f"{data['slo']['ttft_s']:g} s, TPOT {data['slo']['tpot_s']:g} s. smg: `--pd-disaggregation "
             "--prefill-policy cache_aware --decode-policy power_of_two`; Poise: least-load dispatch, static planner.",
             "", "These numbers compare routers on CPU engines, not GPUs: each engine is one core at ~16 tokens/s a "
             "stream.", "",
             "| rate (req/s) | router | ok | TTFT p50 / p90 (ms) | TPOT p50 / p90 (ms) | SLO attainment | output tok/s |",
             "|---|---|---|---|---|---|---|"]
    for r in data["runs"]:
        lines.append(f"| {r['rate_rps']:g} | {r['router']} | {r['ok']}/{r['requests']} | {_ms(r['ttft_p50_s'])} / "
                     f"{_ms(r['ttft_p90_s'])} | {_ms(r['tpot_p50_s'])} / {_ms(r['tpot_p90_s'])} | "
                     f"{r['attainment']:.1%} | {r['output_tokens_per_s']:.1f} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--requests", type=int, default=40)
    p.add_argument("--rates", default="0.5,2")
    args = p.parse_args()
    rates = [float(r) for r in args.rates.split(",")]
    command = "python -m tests.bench.sglang_router_compare" + \
        (f" --requests {args.requests}" if args.requests != 40 else "") + \
        (f" --rates {args.rates}" if args.rates != "0.5,2" else "")
    data = measure(args.requests, rates, lambda line: print(line, file=sys.stderr, flush=True))
    data["command"] = command
    write_results("sglang_router_compare", data, report(data, command))


if __name__ == "__main__":
    main()
