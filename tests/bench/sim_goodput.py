"""Goodput on the papers' slices (8 instances, Llama-3.1-8B/H100): the baselines and the adaptive mixes, on
Arrow's yardstick, to compare with the papers (Poise's own is ``tests/bench/sustained.py``).

Runs ``poise sim goodput`` on the first 10 minutes of Azure code, Azure conversation and Mooncake
conversation (Arrow uses the first 10 minutes of Mooncake), timestamps divided by the rate scale and every
request counted (``--rate-mode compress --warmup-s 0``; ``--rate-mode natural`` runs the slices at natural
time instead), for every baseline (colocated, static-rr,
static-minload, static-best, dynamo-load, dynamo-sla) and the adaptive mixes (arrow, dopd-ratio, poise), and
writes ``tests/bench/results/goodput-<trace>/goodput.{md,json,png}``. ``--policies a,b`` and ``--traces a,b``
run a subset; a subset of the policies is written to ``goodput-<trace>-subset/`` so that it never replaces a
trace's full table.
"""

from __future__ import annotations

import shlex
import subprocess
import sys
from pathlib import Path

OUT = Path("tests/bench/results")


POLICIES = ["colocated", "static-rr", "static-minload", "static-best", "dynamo-load", "dynamo-sla", "arrow",
            "dopd-ratio", "poise"]
TRACES = ["azure-code", "azure-conv", "mooncake-conv"]


def main() -> None:
    policies = POLICIES
    if "--policies" in sys.argv:
        policies = sys.argv[sys.argv.index("--policies") + 1].split(",")
    traces = sys.argv[sys.argv.index("--traces") + 1].split(",") if "--traces" in sys.argv else TRACES
    unknown = sorted(set(traces) - set(TRACES))
    if unknown:
        raise SystemExit(f"unknown trace: {', '.join(unknown)}; known: {', '.join(TRACES)}")
    for trace in traces:
        out = OUT / (f"goodput-{trace}" if policies == POLICIES else f"goodput-{trace}-subset")
        mode = sys.argv[sys.argv.index("--rate-mode") + 1] if "--rate-mode" in sys.argv else "compress"
        cmd = [sys.executable, "-m", "services.cli", "sim", "goodput", "--trace", trace, "--duration-s", "600",
               "--instances", "8", "--out-dir", str(out), "--rate-mode", mode, "--bisections", "6",
               "--probe-above", "0"]
        if mode == "compress":
            cmd += ["--warmup-s", "0"]
        for policy in policies:
            cmd += ["--policies", policy]
        print(f"$ {shlex.join(['poise', *cmd[3:]])}", file=sys.stderr, flush=True)
        subprocess.run(cmd, check=True)


if __name__ == "__main__":
    main()
