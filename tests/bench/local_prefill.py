"""DOPD's local prefill of ultra-short prompts on the decode instances, on and off.

Simulated goodput (highest rate, x the trace's, with >= 90% attainment of Arrow's Table 1 SLOs), 8 instances,
Llama-3.1-8B/H100 profile, first 10 minutes of each trace, for three control planes (static 4P4D least-load,
DOPD's ratio by flips, the Poise mix), each without local prefill and with prompts up to 512 tokens (the
spec's L_us) prefilled on their decode instance. Writes ``tests/bench/results/local_prefill.{md,json}``.
``--tokens N`` sets the threshold.
"""

from __future__ import annotations

import functools
import json
import shlex
import sys
import time
from pathlib import Path

from loadgen.sim.baselines import make_mix
from loadgen.sim.goodput import search_goodput
from loadgen.slo import slo_for
from loadgen.traces import load_trace
from shared.latency import LatencyModel, load_profile

OUT = Path("tests/bench/results")
TRACES = ["azure-code", "azure-conv", "mooncake-conv"]
MIXES = [("static-minload", "4P4D"), ("dopd-ratio", None), ("poise", None)]


def main(argv: list[str]) -> None:
    tokens = int(argv[argv.index("--tokens") + 1]) if "--tokens" in argv else 512
    command = shlex.join([Path(sys.executable).name, "-m", "tests.bench.local_prefill", *argv])
    model = LatencyModel(load_profile())
    rows = []
    for trace in TRACES:
        workload = load_trace(trace).slice(0.0, 600.0)
        short = sum(1 for r in workload.requests if r.input_tokens <= tokens) / len(workload.requests)
        for mix, split in MIXES:
            for local in (0, tokens):
                build = functools.partial(make_mix, mix, 8, split, local_prefill_tokens=local)
                g = search_goodput(workload, build, model, slo_for(trace), bisections=5)
                rows.append({"trace": trace, "mix": mix, "local_prefill_tokens": local, "short_share": short,
                             "goodput_scale": g.goodput_scale})
                print(f"  {trace} {mix} local<={local}: {g.goodput_scale:.2f}x", file=sys.stderr, flush=True)
    lines = ["# DOPD local prefill of ultra-short prompts", "", f"Command: `{command}`", "",
             f"{time.strftime('%Y-%m-%d %H:%M:%S UTC', time.gmtime())}, simulator, 8 instances, Llama-3.1-8B/H100, "
             f"first 10 min, Arrow Table 1 SLOs, goodput at 90% attainment; local: prompts <= {tokens} tokens are "
             "prefilled on their decode instance.", "",
             "| trace | prompts <= threshold | mix | remote only | with local prefill | ratio |",
             "|---|---|---|---|---|---|"]
    for trace in TRACES:
        for mix, _ in MIXES:
            by = {r["local_prefill_tokens"]: r for r in rows if r["trace"] == trace and r["mix"] == mix}
            off, on = by[0]["goodput_scale"], by[tokens]["goodput_scale"]
            lines.append(f"| {trace} | {by[0]['short_share'] * 100:.0f}% | {mix} | {off:.2f}x | {on:.2f}x | "
                         f"{on / off if off else float('nan'):.2f} |")
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "local_prefill.md").write_text("\n".join(lines) + "\n")
    (OUT / "local_prefill.json").write_text(json.dumps({"command": command, "rows": rows}, indent=2))
    print("\n".join(lines))


if __name__ == "__main__":
    main(sys.argv[1:])
