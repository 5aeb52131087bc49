"""The baselines' goodput on the papers' traces (8 instances, Llama-3.1-8B/H100): the bar later policies must beat.

Runs ``poise sim goodput`` on the first 10 minutes of Azure code, Azure conversation and Mooncake
conversation (Arrow uses the first 10 minutes of Mooncake) and writes
``tests/bench/results/goodput-<trace>.{md,json,png}``.
"""

from __future__ import annotations

import shlex
import subprocess
import sys
from pathlib import Path

OUT = Path("tests/bench/results")


def main() -> None:
    for trace in ("azure-code", "azure-conv", "mooncake-conv"):
        out = OUT / f"goodput-{trace}"
        cmd = [sys.executable, "-m", "services.cli", "sim", "goodput", "--trace", trace, "--duration-s", "600",
               "--instances", "8", "--out-dir", str(out)]
        print(f"$ {shlex.join(['poise', *cmd[3:]])}", file=sys.stderr, flush=True)
        subprocess.run(cmd, check=True)


if __name__ == "__main__":
    main()
