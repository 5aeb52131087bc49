"""DOPD's local prefill of ultra-short prompts on the decode instances, on and off.

Two parts, both in the simulator with the Llama-3.1-8B/H100 profile and Arrow's Table 1 SLOs:

1. Goodput (highest rate, x the trace's, with >= 90% attainment; the same search and setup as
   ``tests/bench/sim_goodput.py``: 8 instances, first 10 minutes of each trace) for three control planes on a
   fixed GPU count (static 4P4D least-load, DOPD's ratio by flips, the Poise mix), each with no local
   prefill, with prompts up to 512 tokens (the spec's L_us) prefilled on their decode instance, and with
   that plus Dynamo's queue rule at DOPD's 70B setting (also local while the chosen prefill engine has 16
   requests queued or in flight). At the goodput rate, the share of requests that were prefilled locally.
2. Elastic DOPD (``dopd``) on the day-shaped load of ``tests/bench/dopd_vs_dynamo.py`` (start 1P1D, 8-GPU
   budget), without and with local prefill: SLO attainment and the GPUs it kept.

Writes ``tests/bench/results/local_prefill.{md,json}``. ``--tokens N`` sets the threshold; ``--part
goodput|elastic`` runs one part (the other's rows are then absent from the files).
"""

from __future__ import annotations

import dataclasses
import json
import shlex
import sys
import time
from pathlib import Path
from typing import Any

from loadgen.sim.baselines import PolicyMix, make_mix
from loadgen.sim.goodput import search_goodput
from loadgen.sim.run import simulate
from loadgen.slo import slo_for
from loadgen.traces import load_trace
from shared.latency import LatencyModel, load_profile
from shared.policies.local_prefill import LocalPrefillParams
from tests.bench.dopd_vs_dynamo import RUNS as DAY_RUNS
from tests.bench.dopd_vs_dynamo import day_workload

OUT = Path("tests/bench/results")
TRACES = ["azure-code", "azure-conv", "mooncake-conv"]
MIXES = [("static-minload", "4P4D"), ("dopd-ratio", None), ("poise", None)]
DOPD_70B_QUEUE = 16  # max-prefill-queue-size in DOPD's 70B config (Dynamo's class default: 2)


def _variants(tokens: int) -> dict[str, LocalPrefillParams | None]:
    return {"off": None, "local": LocalPrefillParams(max_local_prefill_tokens=tokens),
            "local+queue": LocalPrefillParams(max_local_prefill_tokens=tokens, max_prefill_queue=DOPD_70B_QUEUE)}


def _builder(mix: str, split: str | None, params: LocalPrefillParams | None) -> Any:
    # The mix as `poise sim` builds it, with only its local-prefill rule replaced.
    def build() -> PolicyMix:
        return dataclasses.replace(make_mix(mix, 8, split), local_prefill=params)
    return build


def goodput_rows(model: LatencyModel, tokens: int) -> list[dict[str, Any]]:
    rows = []
    for trace in TRACES:
        workload = load_trace(trace).slice(0.0, 600.0)
        slo = slo_for(trace)
        short = sum(1 for r in workload.requests if r.input_tokens <= tokens) / len(workload.requests)
        for mix, split in MIXES:
            for variant, params in _variants(tokens).items():
                t0 = time.perf_counter()
                build = _builder(mix, split, params)
                g = search_goodput(workload, build, model, slo)
                # One more run at the goodput rate, for how many requests the rule kept local there.
                at = simulate(workload, build(), model, slo, rate_scale=g.goodput_scale) if g.goodput_scale else None
                local = at.config["local_prefills"] / len(at.records) if at is not None else 0.0
                rows.append({"trace": trace, "mix": mix, "variant": variant,
                             "params": _params(params),
                             "short_share": short, "goodput_scale": g.goodput_scale,
                             "goodput_rps": g.goodput_rps, "local_share_at_goodput": local,
                             "runs": len(g.points), "sim_wall_s": time.perf_counter() - t0})
                print(f"  {trace} {mix} {variant}: {g.goodput_scale:.2f}x, {local:.0%} local "
                      f"({time.perf_counter() - t0:.0f}s)", file=sys.stderr, flush=True)
    return rows


def elastic_rows(model: LatencyModel, tokens: int) -> list[dict[str, Any]]:
    rows = []
    for trace, scale in DAY_RUNS:
        workload = day_workload(trace)
        for variant in ("off", "local"):
            params = _variants(tokens)[variant]
            t0 = time.perf_counter()
            result = simulate(workload, _builder("dopd", "1P1D", params)(), model, slo_for(trace), rate_scale=scale)
            s, lc = result.summary, result.config["lifecycle"]
            rows.append({"trace": trace, "rate_scale": scale, "mix": "dopd", "variant": variant,
                         "params": _params(params), "attainment": s.slo_attainment, "ttft_p90_s": s.ttft_p90_s,
                         "tpot_p90_s": s.tpot_p90_s, "mean_gpus": lc["gpu_seconds"] / s.wall_s,
                         "local_share": result.config["local_prefills"] / len(result.records),
                         "sim_wall_s": time.perf_counter() - t0})
            print(f"  {trace} dopd {variant}: attainment {s.slo_attainment:.1%} "
                  f"({time.perf_counter() - t0:.0f}s)", file=sys.stderr, flush=True)
    return rows


def _params(params: LocalPrefillParams | None) -> dict[str, Any] | None:
    return None if params is None else {"max_local_prefill_tokens": params.max_local_prefill_tokens,
                                        "max_prefill_queue": params.max_prefill_queue}


def report(command: str, tokens: int, goodput: list[dict[str, Any]], elastic: list[dict[str, Any]]) -> str:
    lines = ["# DOPD local prefill of ultra-short prompts", "", f"Command: `{command}`", "",
             f"{time.strftime('%Y-%m-%d %H:%M:%S UTC', time.gmtime())}, simulator, Llama-3.1-8B/H100 profile, "
             f"Arrow Table 1 SLOs. local: prompts <= {tokens} tokens are prefilled on their decode instance; "
             f"local+queue: also any prompt whose chosen prefill engine has {DOPD_70B_QUEUE} requests queued or "
             "in flight (Dynamo's queue rule at DOPD's 70B setting)."]
    if goodput:
        lines += ["", "## Goodput, fixed GPU count", "",
                  "8 instances, first 10 min of each trace, goodput at 90% attainment (the search of "
                  "`tests/bench/sim_goodput.py`); in brackets, the share of requests prefilled locally at that "
                  "rate.", "",
                  "| trace | prompts <= threshold | mix | off | local | local / off | local+queue |",
                  "|---|---|---|---|---|---|---|"]
        for trace in TRACES:
            for mix, _ in MIXES:
                by = {r["variant"]: r for r in goodput if r["trace"] == trace and r["mix"] == mix}
                off, on, q = by["off"], by["local"], by["local+queue"]
                ratio = on["goodput_scale"] / off["goodput_scale"] if off["goodput_scale"] else float("nan")
                lines.append(f"| {trace} | {off['short_share']:.0%} | {mix} | {off['goodput_scale']:.2f}x | "
                             f"{on['goodput_scale']:.2f}x ({on['local_share_at_goodput']:.0%}) | {ratio:.2f} | "
                             f"{q['goodput_scale']:.2f}x ({q['local_share_at_goodput']:.0%}) |")
    if elastic:
        lines += ["", "## Elastic DOPD, day-shaped load", "",
                  "The load of `tests/bench/dopd_vs_dynamo.py` (whole trace warped onto one day-shaped cycle), "
                  "start 1P1D, 8-GPU budget.", "",
                  "| trace | rate x | local prefill | SLO attainment | P90 TTFT s | P90 TPOT ms | mean GPUs | "
                  "requests local |", "|---|---|---|---|---|---|---|---|"]
        for r in elastic:
            lines.append(f"| {r['trace']} | {r['rate_scale']:g} | {r['variant']} | {r['attainment']:.1%} | "
                         f"{r['ttft_p90_s']:.2f} | {r['tpot_p90_s'] * 1e3:.0f} | {r['mean_gpus']:.2f} | "
                         f"{r['local_share']:.0%} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str]) -> None:
    tokens = int(argv[argv.index("--tokens") + 1]) if "--tokens" in argv else 512
    part = argv[argv.index("--part") + 1] if "--part" in argv else "all"
    command = shlex.join([Path(sys.executable).name, "-m", "tests.bench.local_prefill", *argv])
    model = LatencyModel(load_profile())
    goodput = goodput_rows(model, tokens) if part in ("all", "goodput") else []
    elastic = elastic_rows(model, tokens) if part in ("all", "elastic") else []
    text = report(command, tokens, goodput, elastic)
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "local_prefill.md").write_text(text)
    (OUT / "local_prefill.json").write_text(json.dumps(
        {"command": command, "tokens": tokens, "goodput": goodput, "elastic": elastic}, indent=2))
    print(text)


if __name__ == "__main__":
    main(sys.argv[1:])
