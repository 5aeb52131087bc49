"""NVIDIA aiperf, a benchmark client nobody here wrote, pointed at Poise, next to Poise's own numbers.

A `poise up` stack (engine_sim 2P2D, auth on) serves streaming chat to aiperf 0.13 at a fixed concurrency;
then the same request counts, TTFT and inter-token latency are read from the gateway's ``/metrics``. What it
takes, as a user would do it:

- aiperf needs a local tokenizer for its synthetic prompts (its default downloads one): ``--tokenizer`` is
  SmolLM2's, which ``make sglang-setup`` installs (any Hugging Face tokenizer directory will do);
- ``--use-server-token-count``: engine_sim has no model and no tokenizer; its text is one placeholder word a
  token (" tok1234"), which a real tokenizer splits into several, so only the usage the server reports counts
  the tokens it generated (Poise passes SGLang's usage through unchanged);
- ``--extra-inputs ignore_eos:true`` so every answer is ``--output-tokens-mean`` long, and ``--api-key``,
  the stack's gateway key.

aiperf is installed into a venv of its own (``.venv-aiperf``; its dependencies are not Poise's), once.

    python -m tests.bench.aiperf_run [--concurrency 4] [--requests 200] [--tokenizer DIR]

Writes ``tests/bench/results/aiperf.{md,json}``.
"""

from __future__ import annotations

import json
import shlex
import subprocess
import time
from pathlib import Path
from typing import Any

from tests.bench.client_runs import OUT, gateway_metrics, load_client_main, poise_side, served_stack, tool_bin

AIPERF = "aiperf==0.13.0"
VENV = Path(".venv-aiperf")


def _metric(records: dict[str, Any], name: str, stat: str) -> float | None:
    entry = records.get(name)
    return float(entry[stat]) if isinstance(entry, dict) and entry.get(stat) is not None else None


def run(concurrency: int, requests: int, tokenizer: Path, input_tokens: int, output_tokens: int) -> dict[str, Any]:
    exe = tool_bin(VENV, AIPERF, "aiperf")
    with served_stack("poise-aiperf-") as (stack, state):
        before = gateway_metrics(stack.gateway_url)
        artifacts = state / "aiperf"
        cmd = [str(exe), "profile", "-m", stack.settings.model, "--url", stack.gateway_url,
               "--endpoint-type", "chat", "--streaming", "--tokenizer", str(tokenizer.resolve()),
               "--use-server-token-count", "--concurrency", str(concurrency), "--request-count", str(requests),
               "--synthetic-input-tokens-mean", str(input_tokens), "--synthetic-input-tokens-stddev", "0",
               "--output-tokens-mean", str(output_tokens), "--output-tokens-stddev", "0",
               "--extra-inputs", "ignore_eos:true", "--api-key", stack.api_key or "none",
               "--artifact-dir", str(artifacts), "--ui-type", "none"]
        print("$ " + shlex.join(cmd).replace(stack.api_key or "\0", "<key>"), flush=True)
        t0 = time.monotonic()
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
        wall = time.monotonic() - t0
        if proc.returncode != 0:
            raise SystemExit(f"aiperf failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
        after = gateway_metrics(stack.gateway_url)
        records = json.loads(next(artifacts.rglob("profile_export_aiperf.json")).read_text())
    return {
        "aiperf": AIPERF, "concurrency": concurrency, "requests": requests, "input_tokens": input_tokens,
        "output_tokens": output_tokens, "wall_s": round(wall, 1),
        "aiperf_request_count": _metric(records, "request_count", "avg"),
        "aiperf_errors": _metric(records, "error_request_count", "avg") or 0.0,
        "aiperf_ttft_ms": {s: _metric(records, "time_to_first_token", s) for s in ("avg", "p50", "p99")},
        "aiperf_itl_ms": {s: _metric(records, "inter_token_latency", s) for s in ("avg", "p50", "p99")},
        "aiperf_output_tokens_per_request": _metric(records, "output_sequence_length", "avg"),
        "aiperf_request_throughput": _metric(records, "request_throughput", "avg"),
        **poise_side(before, after),
    }


def write(result: dict[str, Any], command: str) -> None:
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "aiperf.json").write_text(json.dumps({"command": command, **result}, indent=2) + "\n")
    r = result
    ttft, itl = r["aiperf_ttft_ms"], r["aiperf_itl_ms"]
    lines = [
        "# aiperf against Poise's gateway", "", f"`{command}` ({time.strftime('%Y-%m-%d')}; {r['aiperf']}; "
        f"engine_sim 2P2D as `poise up` starts it; streaming chat, concurrency {r['concurrency']}, "
        f"{r['input_tokens']} prompt tokens and {r['output_tokens']} output tokens a request; wall {r['wall_s']} s)",
        "", "| | aiperf | Poise's /metrics |", "|---|---|---|",
        f"| requests (OK / other) | {r['aiperf_request_count']:g} ({r['aiperf_errors']:g} errors) | "
        f"{r['poise_requests_ok']:g} / {r['poise_requests_other']:g} |",
        f"| TTFT mean (ms) | {ttft['avg']:.2f} (p50 {ttft['p50']:.2f}, p99 {ttft['p99']:.2f}) | "
        f"{r['poise_ttft_ms_mean']:.2f} |",
        f"| inter-token latency / TPOT mean (ms) | {itl['avg']:.3f} (p50 {itl['p50']:.3f}, p99 {itl['p99']:.3f}) | "
        f"{r['poise_tpot_ms_mean']:.3f} |",
        f"| output tokens a request (server count) | {r['aiperf_output_tokens_per_request']:g} | |",
        f"| request throughput (req/s) | {r['aiperf_request_throughput']:.2f} | |", "",
        "aiperf's TTFT counts from its send, Poise's from the gateway's receipt of the request; aiperf's "
        "inter-token latency is read where it receives the stream, Poise's TPOT (last token - first token) / "
        "(tokens - 1) where the gateway sends it: the differences are the client's and the loopback's share.", ""]
    (OUT / "aiperf.md").write_text("\n".join(lines))
    print("\n".join(lines))


def main() -> None:
    load_client_main(__doc__ or "", "tests.bench.aiperf_run", run, write)


if __name__ == "__main__":
    main()
