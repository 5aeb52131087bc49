"""Goodput on the papers' traces (8 instances, Llama-3.1-8B/H100): the baselines and the adaptive mixes.

Runs ``poise sim goodput`` on the first 10 minutes of Azure code, Azure conversation and Mooncake
conversation (Arrow uses the first 10 minutes of Mooncake) for every baseline (colocated, static-rr,
static-minload, static-best, dynamo-load, dynamo-sla) and the adaptive mixes (arrow, dopd-ratio, poise), and
writes ``tests/bench/results/goodput-<trace>/goodput.{md,json,png}``. ``--policies a,b`` runs a subset.
"""

from __future__ import annotations

import shlex
import subprocess
import sys
from pathlib import Path

OUT = Path("tests/bench/results")


POLICIES = ["colocated", "static-rr", "static-minload", "static-best", "dynamo-load", "dynamo-sla", "arrow",
            "dopd-ratio", "poise"]


def main() -> None:
    policies = POLICIES
    if "--policies" in sys.argv:
        policies = sys.argv[sys.argv.index("--policies") + 1].split(",")
    for trace in ("azure-code", "azure-conv", "mooncake-conv"):
        out = OUT / f"goodput-{trace}"
        cmd = [sys.executable, "-m", "services.cli", "sim", "goodput", "--trace", trace, "--duration-s", "600",
               "--instances", "8", "--out-dir", str(out)]
        for policy in policies:
            cmd += ["--policies", policy]
        print(f"$ {shlex.join(['poise', *cmd[3:]])}", file=sys.stderr, flush=True)
        subprocess.run(cmd, check=True)


if __name__ == "__main__":
    main()
