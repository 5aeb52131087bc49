"""schemathesis, a schema-driven fuzzer nobody here wrote, against the gateway's own ``/openapi.json``.

A `poise up` stack (engine_sim 2P2D, auth on) is fuzzed by schemathesis 4.32 from the schema the gateway
serves: examples, coverage and fuzzing phases, positive and negative cases, every check schemathesis has
(no 5xx, status codes and content types and bodies as the schema declares them, invalid bodies refused,
valid ones accepted, ...). Afterwards the stack must still serve, and the gateway's ``/metrics`` must hold no
5xx. What it takes, as a user would do it: ``--header "Authorization: Bearer <key>"`` (the stack's gateway
key), and a ``--request-timeout`` above the longest answer the schema allows (``max_tokens`` up to the
context: engine_sim generates it in real time).

schemathesis is installed into a venv of its own (``.venv-schemathesis``; its dependencies are not Poise's),
once.

    python -m tests.bench.schemathesis_run [--max-examples 50] [--seed 1]

Writes ``tests/bench/results/schemathesis.{md,json}``.
"""

from __future__ import annotations

import argparse
import json
import re
import shlex
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

from tests.bench.client_runs import OUT, served_stack, tool_bin

SCHEMATHESIS = "schemathesis==4.32.5"
VENV = Path(".venv-schemathesis")


def gateway_outcomes(url: str) -> dict[str, float]:
    """The gateway's finished inference requests by outcome, and its refusals before dispatch by reason."""
    text = httpx.get(url + "/metrics", timeout=10).text
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == "poise_gateway_requests_total":
                key = f"finished {s.labels['status']}"
            elif s.name == "poise_gateway_rejections_total":
                key = f"refused {s.labels['reason']}"
            else:
                continue
            out[key] = out.get(key, 0.0) + s.value
    return out


def junit_cases(path: Path) -> list[dict[str, Any]]:
    """One row per operation from schemathesis' JUnit report: its name and the failures' messages."""
    rows = []
    for case in ET.parse(path).getroot().iter("testcase"):
        problems = [(el.get("message") or el.text or "").strip() for el in case if el.tag in ("failure", "error")]
        rows.append({"operation": case.get("name", "?"), "problems": problems})
    return rows


def summary_counts(stdout: str) -> dict[str, int]:
    """The test-case counts from schemathesis' summary (``Test cases: N generated, N found M unique failures``)."""
    counts: dict[str, int] = {}
    m = re.search(r"Test cases:\s*(\d+) generated", stdout)
    if m:
        counts["generated"] = int(m.group(1))
    m = re.search(r"(\d+) passed", stdout[stdout.rfind("Test cases:"):] if "Test cases:" in stdout else "")
    if m:
        counts["passed"] = int(m.group(1))
    m = re.search(r"(\d+) unique failures?", stdout)
    counts["unique_failures"] = int(m.group(1)) if m else 0
    return counts


def failures(stdout: str) -> list[dict[str, str]]:
    """Each failure schemathesis printed: its operation, check, and the status and body the gateway answered."""
    section = stdout[stdout.find("FAILURES"):stdout.find("SUMMARY")] if "FAILURES" in stdout else ""
    out = []
    for block in re.split(r"\n_{5,} (?=[A-Z]+ /)", section)[1:]:
        operation = block.split(" _", 1)[0].strip()
        for m in re.finditer(r"- (ST\d+ [^\n]+)\n.*?\[(\d{3})\][^\n]*\n\n\s+`([^`]*)`", block, re.DOTALL):
            out.append({"operation": operation, "check": m.group(1).strip(), "status": m.group(2),
                        "answer": m.group(3)[:400]})
    return out


def run(max_examples: int, seed: int, workers: int) -> dict[str, Any]:
    exe = tool_bin(VENV, SCHEMATHESIS, "st")
    with served_stack("poise-schemathesis-") as (stack, state):
        key = stack.api_key or "none"
        before = gateway_outcomes(stack.gateway_url)
        report = state / "report"
        cmd = [str(exe), "run", stack.gateway_url + "/openapi.json", "--checks", "all",
               "--header", f"Authorization: Bearer {key}", "--max-examples", str(max_examples),
               "--seed", str(seed), "--workers", str(workers), "--request-timeout", "120",
               "--report", "junit", "--report-dir", str(report), "--no-color", "--continue-on-failure",
               "--generation-database", "none"]
        print("$ " + shlex.join(cmd).replace(key, "<key>"), flush=True)
        t0 = time.monotonic()
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=3600)
        wall = time.monotonic() - t0
        after = gateway_outcomes(stack.gateway_url)
        health = httpx.get(stack.gateway_url + "/health", timeout=10).status_code
        served = httpx.post(stack.gateway_url + "/v1/chat/completions", timeout=60,
                            headers={"Authorization": f"Bearer {key}"},
                            json={"model": stack.settings.model, "max_tokens": 8,
                                  "messages": [{"role": "user", "content": "after the fuzzing"}]}).status_code
        junit = next(report.rglob("*.xml"), None)
        cases = junit_cases(junit) if junit is not None else []
    outcomes = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in after}
    server_errors = [op["operation"] for op in cases if any("server error" in p.lower() for p in op["problems"])]
    return {
        "schemathesis": SCHEMATHESIS, "max_examples": max_examples, "seed": seed, "workers": workers,
        "wall_s": round(wall, 1), "exit_code": proc.returncode, "counts": summary_counts(proc.stdout),
        "failures": failures(proc.stdout),
        "operations": cases, "gateway_outcomes": {k: v for k, v in sorted(outcomes.items()) if v},
        "operations_with_5xx": server_errors,
        "health_after": health, "chat_after": served, "stdout_tail": proc.stdout[-6000:],
    }


def write(result: dict[str, Any], command: str) -> None:
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "schemathesis.json").write_text(json.dumps({"command": command, **result}, indent=2) + "\n")
    r = result
    c = r["counts"]
    lines = [
        "# schemathesis against Poise's gateway", "",
        f"`{command}` ({time.strftime('%Y-%m-%d')}; {r['schemathesis']}; engine_sim 2P2D as `poise up` starts it; "
        f"the gateway's served `/openapi.json`, every check, {r['max_examples']} examples an operation, seed "
        f"{r['seed']}; wall {r['wall_s']} s; schemathesis exit code {r['exit_code']})", "",
        f"- test cases: {c.get('generated', '?')} generated, {c.get('unique_failures', 0)} unique failures",
        "- the gateway's inference requests meanwhile (its /metrics): "
        + (", ".join(f"{k}: {v:g}" for k, v in r["gateway_outcomes"].items()) or "none"),
        f"- operations with a 5xx: {', '.join(r['operations_with_5xx']) or 'none'}; after the run `/health` "
        f"{r['health_after']}, a chat completion {r['chat_after']}", "", "| operation | problems |", "|---|---|"]
    for op in r["operations"]:
        problems = "; ".join(p.splitlines()[0][:160] for p in op["problems"] if p) or "none"
        lines.append(f"| `{op['operation']}` | {problems} |")
    lines += ["", "Failures, with the gateway's answer:", ""]
    lines += [f"- `{f['operation']}` {f['check']}: {f['status']} `{f['answer']}`" for f in r["failures"]] or ["- none"]
    lines.append("")
    (OUT / "schemathesis.md").write_text("\n".join(lines))
    print("\n".join(lines))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--max-examples", type=int, default=50)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--workers", type=int, default=2)
    args = parser.parse_args()
    result = run(args.max_examples, args.seed, args.workers)
    write(result, shlex.join(["python", "-m", "tests.bench.schemathesis_run", *sys.argv[1:]]))


if __name__ == "__main__":
    main()
