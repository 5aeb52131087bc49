"""What the benchmarks of third-party clients (aiperf, GuideLLM, schemathesis) share: the client's own venv,
a `poise up` stack to point it at, and Poise's side of the numbers from the gateway's ``/metrics``."""

from __future__ import annotations

import argparse
import contextlib
import shlex
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

from services.cli.stack import Stack, StackSettings

TOKENIZER = Path(".venv-sglang/models/smollm2-135m")  # SmolLM2's, which `make sglang-setup` installs
OUT = Path("tests/bench/results")


def tool_bin(venv: Path, package: str, exe: str) -> Path:
    """``exe`` of ``package``, installed once into a venv of its own (its dependencies are not Poise's)."""
    path = venv / "bin" / exe
    if not path.exists():
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
        subprocess.run([str(venv / "bin" / "pip"), "install", "--quiet", package], check=True)
    return path


@contextlib.contextmanager
def served_stack(prefix: str) -> Iterator[tuple[Stack, Path]]:
    """A `poise up` stack on free ports (engine_sim 2P2D, auth on) and a scratch directory, both gone after."""
    with tempfile.TemporaryDirectory(prefix=prefix) as tmp:
        state = Path(tmp)
        stack = Stack(StackSettings(gateway_port=0, monitor_port=0, state_dir=state, run_dir=state / "run"),
                      progress=print)
        stack.start()
        try:
            yield stack, state
        finally:
            stack.stop()


def gateway_metrics(url: str) -> dict[str, float]:
    """The gateway's request counts by status, and its TTFT and TPOT sums and counts."""
    text = httpx.get(url + "/metrics", timeout=10).text
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == "poise_gateway_requests_total":
                key = f"requests_{s.labels['status']}"
                out[key] = out.get(key, 0.0) + s.value
            elif s.name in ("poise_gateway_ttft_seconds_sum", "poise_gateway_ttft_seconds_count",
                            "poise_gateway_tpot_seconds_sum", "poise_gateway_tpot_seconds_count"):
                out[s.name.removeprefix("poise_gateway_")] = s.value
    return out


def poise_side(before: dict[str, float], after: dict[str, float]) -> dict[str, Any]:
    """What the gateway counted between two readings of its metrics: requests OK and other, mean TTFT and TPOT."""
    d = {k: v - before.get(k, 0.0) for k, v in after.items()}
    return {
        "poise_requests_ok": d.get("requests_ok", 0.0),
        "poise_requests_other": sum(v for k, v in d.items() if k.startswith("requests_") and k != "requests_ok"),
        "poise_ttft_ms_mean": 1000 * d["ttft_seconds_sum"] / d["ttft_seconds_count"]
        if d.get("ttft_seconds_count") else None,
        "poise_tpot_ms_mean": 1000 * d["tpot_seconds_sum"] / d["tpot_seconds_count"]
        if d.get("tpot_seconds_count") else None,
    }


def load_client_main(doc: str, module: str, run: Callable[..., dict[str, Any]],
                     write: Callable[[dict[str, Any], str], None]) -> None:
    """The command line of a load client's benchmark: concurrency, requests, lengths and a tokenizer."""
    parser = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--requests", type=int, default=200)
    parser.add_argument("--input-tokens", type=int, default=256)
    parser.add_argument("--output-tokens", type=int, default=64)
    parser.add_argument("--tokenizer", type=Path, default=TOKENIZER, help="a Hugging Face tokenizer directory")
    args = parser.parse_args()
    if not (args.tokenizer / "tokenizer.json").exists():
        raise SystemExit(f"no tokenizer at {args.tokenizer}: run `make sglang-setup` or pass --tokenizer DIR")
    result = run(args.concurrency, args.requests, args.tokenizer, args.input_tokens, args.output_tokens)
    write(result, shlex.join(["python", "-m", module, *sys.argv[1:]]))
