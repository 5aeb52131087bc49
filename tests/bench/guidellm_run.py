"""GuideLLM, the vLLM project's benchmark client, pointed at Poise, next to Poise's own numbers.

A `poise up` stack (engine_sim 2P2D, auth on) serves streaming chat to GuideLLM 0.8 at a fixed concurrency;
then the request counts, TTFT and inter-token latency are read from the gateway's ``/metrics``. What it takes,
as a user would do it (GuideLLM 0.8 takes ``kind=...`` specs, with dots for nested fields):

- ``--backend kind=openai_http,target=<gateway>,model=<served model>,api_key=<key>``, and
  ``extras.body.ignore_eos=true`` so every answer is ``output_tokens`` long (engine_sim stops at a sampled
  length otherwise);
- ``--tokenizer kind=huggingface_auto,model=<dir>``: a local tokenizer for its synthetic prompts (SmolLM2's,
  which ``make sglang-setup`` installs); GuideLLM counts output by the server's usage, so engine_sim's
  placeholder words (one token each, several for a real tokenizer) do not skew its token counts;
- ``--data kind=synthetic_text,prompt_tokens=N,output_tokens=M``, ``--profile kind=concurrent,streams=C`` and
  ``--constraint kind=max_requests,count=R``.

GuideLLM is installed into a venv of its own (``.venv-guidellm``; its dependencies, torch included, are not
Poise's), once.

    python -m tests.bench.guidellm_run [--concurrency 4] [--requests 200] [--tokenizer DIR]

Writes ``tests/bench/results/guidellm.{md,json}``.
"""

from __future__ import annotations

import json
import shlex
import subprocess
import time
from pathlib import Path
from typing import Any

from tests.bench.client_runs import OUT, gateway_metrics, load_client_main, poise_side, served_stack, tool_bin

GUIDELLM = "guidellm==0.8.1"
VENV = Path(".venv-guidellm")


def _stat(metrics: dict[str, Any], name: str, field: str) -> float | None:
    """One statistic of a GuideLLM metric over the successful requests (its report nests them so)."""
    entry = metrics.get(name)
    if not isinstance(entry, dict):
        return None
    for key in ("successful", "total"):
        stats = entry.get(key)
        if isinstance(stats, dict):
            if field in stats:
                return float(stats[field])
            pct = stats.get("percentiles")
            if isinstance(pct, dict) and field in pct:
                return float(pct[field])
    return None


def run(concurrency: int, requests: int, tokenizer: Path, input_tokens: int, output_tokens: int) -> dict[str, Any]:
    exe = tool_bin(VENV, GUIDELLM, "guidellm")
    with served_stack("poise-guidellm-") as (stack, state):
        key = stack.api_key or "none"
        before = gateway_metrics(stack.gateway_url)
        report = state / "guidellm.json"
        cmd = [str(exe), "run",
               "--backend", f"kind=openai_http,target={stack.gateway_url},model={stack.settings.model},"
                            f"api_key={key},extras.body.ignore_eos=true",
               "--tokenizer", f"kind=huggingface_auto,model={tokenizer.resolve()}",
               "--data", f"kind=synthetic_text,prompt_tokens={input_tokens},output_tokens={output_tokens}",
               "--profile", f"kind=concurrent,streams={concurrency}",
               "--constraint", f"kind=max_requests,count={requests}",
               "--output", f"kind=json,path={report}", "--disable-console-interactive"]
        print("$ " + shlex.join(cmd).replace(key, "<key>"), flush=True)
        t0 = time.monotonic()
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
        wall = time.monotonic() - t0
        if proc.returncode != 0 or not report.exists():
            raise SystemExit(f"guidellm failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
        after = gateway_metrics(stack.gateway_url)
        doc = json.loads(report.read_text())
    bench = doc["benchmarks"][0]
    metrics = bench.get("metrics", {})
    totals = metrics.get("request_totals") or bench.get("request_totals") or {}
    if not totals:
        raise SystemExit(f"no request totals in GuideLLM's report (keys: {sorted(bench)}, {sorted(metrics)})")
    return {
        "guidellm": GUIDELLM, "concurrency": concurrency, "requests": requests, "input_tokens": input_tokens,
        "output_tokens": output_tokens, "wall_s": round(wall, 1),
        "guidellm_requests": {k: totals.get(k) for k in ("successful", "errored", "incomplete", "total")},
        "guidellm_ttft_ms": {s: _stat(metrics, "time_to_first_token_ms", s) for s in ("mean", "median", "p99")},
        "guidellm_itl_ms": {s: _stat(metrics, "inter_token_latency_ms", s) for s in ("mean", "median", "p99")},
        "guidellm_output_tokens_per_request": _stat(metrics, "output_token_count", "mean"),
        **poise_side(before, after),
    }


def _fmt(x: float | None, digits: int = 2) -> str:
    return "-" if x is None else f"{x:.{digits}f}"


def write(result: dict[str, Any], command: str) -> None:
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "guidellm.json").write_text(json.dumps({"command": command, **result}, indent=2) + "\n")
    r = result
    ttft, itl, n = r["guidellm_ttft_ms"], r["guidellm_itl_ms"], r["guidellm_requests"]
    lines = [
        "# GuideLLM against Poise's gateway", "", f"`{command}` ({time.strftime('%Y-%m-%d')}; {r['guidellm']}; "
        f"engine_sim 2P2D as `poise up` starts it; streaming chat, concurrency {r['concurrency']}, "
        f"{r['input_tokens']} prompt tokens and {r['output_tokens']} output tokens a request; wall {r['wall_s']} s)",
        "", "| | GuideLLM | Poise's /metrics |", "|---|---|---|",
        f"| requests (successful / errored / incomplete) | {n['successful']} / {n['errored']} / {n['incomplete']} | "
        f"{r['poise_requests_ok']:g} OK / {r['poise_requests_other']:g} other |",
        f"| TTFT mean (ms) | {_fmt(ttft['mean'])} (median {_fmt(ttft['median'])}, p99 {_fmt(ttft['p99'])}) | "
        f"{_fmt(r['poise_ttft_ms_mean'])} |",
        f"| inter-token latency / TPOT mean (ms) | {_fmt(itl['mean'], 3)} (median {_fmt(itl['median'], 3)}, p99 "
        f"{_fmt(itl['p99'], 3)}) | {_fmt(r['poise_tpot_ms_mean'], 3)} |",
        f"| output tokens a request | {_fmt(r['guidellm_output_tokens_per_request'], 1)} | |", "",
        "GuideLLM's TTFT counts from its send, Poise's from the gateway's receipt of the request; GuideLLM's "
        "inter-token latency is read where it receives the stream, Poise's TPOT where the gateway sends it.", ""]
    (OUT / "guidellm.md").write_text("\n".join(lines))
    print("\n".join(lines))


def main() -> None:
    load_client_main(__doc__ or "", "tests.bench.guidellm_run", run, write)


if __name__ == "__main__":
    main()
