"""SGLang's own router beside Poise's gateway, in front of the same real SGLang engines (CPU, SmolLM2-135M-Instruct:
one prefill, two decode, the sglang-cpu preset, one core each). SGLang's router is `smg` 1.13 with
``--pd-disaggregation``, ``cache_aware`` prefill and ``power_of_two`` decode (its PD defaults in SGLang's docs);
Poise's gateway runs its default dispatch for stock engines (least-load) with no planner moves (static). Both
get the same open-loop replay from Poise's load client: the Azure conversation slices of
tests/bench/sglang_fidelity.py at lower rates, prompts and answers capped the same way, judged by the same
CPU SLO.

On this hardware the numbers compare routers (their placement and their own overhead), not GPUs: every engine is
one CPU core running a 135M model.

    python -m tests.bench.sglang_router_compare     (~15 min; make sglang-setup first)

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
from loadgen.workload import Workload
from services.worker.presets import sglang_cpu_venv
from shared.devservers import free_port
from tests.bench.sglang_cpu_costs import write_results
from tests.bench.sglang_fidelity import CPU_SLO, MAX_INPUT, MAX_OUTPUT, TRACE, workload_for
from tests.sglang.realstack import MODEL, real_stack, until

#: The load client's text prompts are sized at ~4 characters a token (Llama's); SmolLM2's tokenizer makes 2.1
#: tokens of each such "token" (4095 characters -> 2148 tokens), so the text is cut to half the fidelity
#: bench's token cap to give the engines prompts of about the same real length.
TEXT_TOKENS_PER_TOKEN = 2.1
#: The fidelity bench's slices (trace start s, wall s) at lower rates: three one-core engines on two cores,
#: with text prompts, were past capacity at its 0.07 (both routers failed requests there).
SLICES = [(1200.0, 180.0, 0.015, "light"), (1800.0, 180.0, 0.035, "moderate")]


def _ok(url: str) -> bool:
    try:
        return httpx.get(url, timeout=2, trust_env=False).status_code == 200
    except httpx.HTTPError:
        return False


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
        return _ok(url + "/v1/models")

    until(up, 120, "smg serving")
    return proc, url


def run_one(url: str, load: Workload, rate: float) -> dict[str, Any]:
    # chat: smg 1.13 takes a completions prompt only as text ("prompt: data did not match any variant of untagged
    # enum StringOrArray" for token ids, which the OpenAI API allows), so both routers get the same text prompts
    result = asyncio.run(replay(load, url, model=MODEL, endpoint="chat", rate_scale=rate, slo=CPU_SLO, timeout_s=600,
                                send_slo=False, keep_token_times=False))
    s = result.summary
    return {"requests": s.requests_total, "ok": s.requests_ok, "failed": s.requests_failed,
            "errors": sorted({r.error for r in result.records if r.error})[:5],
            "ttft_p50_s": s.ttft_p50_s, "ttft_p90_s": s.ttft_p90_s, "tpot_p50_s": s.tpot_p50_s,
            "tpot_p90_s": s.tpot_p90_s, "attainment": s.slo_attainment, "output_tokens_per_s": s.output_tokens_per_s,
            "wall_s": s.wall_s}


def measure(say: Any) -> dict[str, Any]:
    out: dict[str, Any] = {"trace": TRACE, "max_input": MAX_INPUT, "max_output": MAX_OUTPUT,
                           "slo": {"ttft_s": CPU_SLO.ttft_s, "tpot_s": CPU_SLO.tpot_s}, "runs": []}
    with tempfile.TemporaryDirectory() as tmp, real_stack(Path(tmp), prefill=1, decode=2, auth=False) as stack:
        until(lambda: _ok(stack.gateway_url + "/health"), 300, "Poise's gateway serving")  # 200 = a pair can serve
        proc, smg_url = start_smg(stack.engines, stack.bootstrap_ports, Path(tmp) / "smg.log")
        try:
            for start, duration, rate, role in SLICES:
                load = workload_for(start, duration, rate).cap_lengths(max_input=int(MAX_INPUT / TEXT_TOKENS_PER_TOKEN))
                # smg first on one slice, Poise first on the other: neither always meets the warmer engines
                order = [("smg", smg_url), ("poise", stack.gateway_url)]
                for router, url in order if len(out["runs"]) % 4 == 0 else order[::-1]:
                    t0 = time.monotonic()
                    row = {"router": router, "slice": role, "slice_s": [start, duration], "rate_scale": rate,
                           **run_one(url, load, rate)}
                    out["runs"].append(row)
                    say(f"{router}, {role}: {row['ok']}/{row['requests']} ok, attainment {row['attainment']:.1%}, "
                        f"TTFT p50 {row['ttft_p50_s']}, errors {row['errors']} ({time.monotonic() - t0:.0f}s)")
        finally:
            proc.terminate()
            proc.wait(15)
            out["smg_log_tail"] = (Path(tmp) / "smg.log").read_text(errors="replace")[-3000:]
    return out


def _ms(v: float | None) -> str:
    return "-" if v is None else f"{v * 1000:.0f}"


def report(data: dict[str, Any]) -> str:
    lines = ["# SGLang's router (smg) beside Poise's gateway, on the same real SGLang engines (CPU)", "",
             f"`{data['command']}`: SGLang 0.5.23 on this CPU, SmolLM2-135M-Instruct, 1 prefill + 2 decode engines "
             f"(sglang-cpu preset, one core each) on a 2-core machine. Load: the {data['trace']} slices of "
             "sglang_fidelity.md at lower rates (below), prompts capped at "
             f"{data['max_input']} tokens and outputs at {data['max_output']} (exact, ignore_eos), streamed "
             f"chat completions with text prompts of about those lengths in SmolLM2's tokens (smg 1.13 refuses token-id prompts on "
             f"/v1/completions with a 400); SLO for this CPU TTFT {data['slo']['ttft_s']:g} s, TPOT {data['slo']['tpot_s']:g} s. "
             "smg: `--pd-disaggregation --prefill-policy cache_aware --decode-policy power_of_two`; Poise: least-load "
             "dispatch, static planner, no late binding (stock engines). The two routers ran one after the other on "
             "the same engines, in alternating order.", "",
             "These numbers compare routers on CPU engines, not GPUs: each engine is one core running a 135M model, "
             "and three engines share two cores.", "",
             "| slice | rate x | router | ok | TTFT p50 / p90 (ms) | TPOT p50 / p90 (ms) | SLO attainment | output tok/s |",
             "|---|---|---|---|---|---|---|---|"]
    for r in data["runs"]:
        lines.append(f"| {r['slice']} | {r['rate_scale']:g} | {r['router']} | {r['ok']}/{r['requests']} | "
                     f"{_ms(r['ttft_p50_s'])} / {_ms(r['ttft_p90_s'])} | {_ms(r['tpot_p50_s'])} / "
                     f"{_ms(r['tpot_p90_s'])} | {r['attainment']:.1%} | {r['output_tokens_per_s']:.1f} |")
    errors = [f"- {r['router']}, {r['slice']}: {', '.join(r['errors'])}" for r in data["runs"] if r["errors"]]
    if errors:
        lines += ["", "Failures (first kinds):", "", *errors]
    return "\n".join(lines) + "\n"


def main() -> None:
    argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter).parse_args()
    data = measure(lambda line: print(line, file=sys.stderr, flush=True))
    data["command"] = "python -m tests.bench.sglang_router_compare"
    write_results("sglang_router_compare", data, report(data))


if __name__ == "__main__":
    main()
