"""SGLang's radix prefix cache on the Mooncake traces: how much of the trace's reuse a cluster gets, and what
each dispatch policy makes of it (simulator, Llama-3.1-8B/H100 profile, 8 instances at a fixed 4P4D).

Per trace (Mooncake conversation and synthetic, whole, at natural time):

- the reuse bounds: the share of prompt tokens an earlier request already sent (an unbounded cache: the
  trace's own 37% / 65%), and what one LRU cache of the prefill side's pooled KV (4 x the profile's capacity)
  or of one engine's keeps of it, in arrival order (``shared.engine.prefix_cache``);
- per dispatch policy, with the engines' prefix cache: least-load (``static-minload``), SMG's ``cache_aware``
  (``static-cache-aware``) and Poise's dispatch (``static-arrow``: Arrow's least predicted TTFT, a cached
  prefix priced by the prefill it saves), and least-load without the cache as the reference: at the trace's
  own rate the hit rate, TTFT P50/P90/P99 and attainment; and goodput on the sustained yardstick (natural
  time, first 120 s not counted, 90% attainment).

Above 1x the natural rate mode's added requests carry their source's prefix blocks in a namespace of their
own (``loadgen.rate_scaling``): the hit rates at the goodput point are a lower estimate of a real cluster's.

``--part split`` asks what the cache does to the P:D question: with every engine caching, the goodput of every
fixed split (the oracle ``static-best``), colocated engines and Poise (starting at 4P4D; its split scoring
and dispatch price the uncached part of each prompt), beside the same without the cache.

Writes ``tests/bench/results/prefix_cache.{md,json,png}`` (``--part dispatch``, the default) or
``prefix_cache_split.{md,json}`` (``--part split``).
"""

from __future__ import annotations

import argparse
import functools
import json
import shlex
import sys
import time
from pathlib import Path
from typing import Any

from loadgen.sim.baselines import make_mix
from loadgen.sim.goodput import Yardstick, at_goodput, search_goodput
from loadgen.sim.run import simulate
from loadgen.slo import slo_for
from loadgen.traces import load_trace
from shared.engine import PrefixCache, reuse_bound
from shared.latency import LatencyModel, load_profile

OUT = Path("tests/bench/results")
TRACES = ["mooncake-conv", "mooncake-synthetic"]
SPLIT = "4P4D"
INSTANCES = 8
PREFILL_INSTANCES = 4
#: (label, mix, engines cache prefixes)
POLICIES = [("least-load, no cache", "static-minload", False), ("least-load", "static-minload", True),
            ("SMG cache_aware", "static-cache-aware", True), ("Poise (TTFT-priced)", "static-arrow", True)]
MODEL = LatencyModel(load_profile())


def lru_bound(prompts: list[tuple[tuple[int, ...], int, float]], capacity: int) -> float:
    """The hit rate of one LRU prefix cache of ``capacity`` tokens over the prompts in arrival order."""
    cache = PrefixCache()
    for blocks, tokens, at in prompts:
        hold = cache.acquire(blocks, tokens, at)
        cache.insert(hold, at)
        cache.release(hold, at)
        if cache.tokens > capacity:
            cache.evict(cache.tokens - capacity)
    return cache.hit_rate


def measure(trace: str) -> dict[str, Any]:
    w = load_trace(trace)
    slo = slo_for(trace)
    prompts = [(r.hash_ids, r.input_tokens, r.arrival_s) for r in w.requests]
    kv = MODEL.profile.kv_capacity_tokens
    out: dict[str, Any] = {
        "trace": trace, "requests": len(w), "rate_rps": w.mean_rate_rps,
        "bounds": {"unbounded": reuse_bound([(b, n) for b, n, _ in prompts]),
                   "pooled_prefill_kv": lru_bound(prompts, PREFILL_INSTANCES * kv), "one_engine_kv": lru_bound(prompts, kv)},
        "policies": [],
    }
    for label, mix, cache in POLICIES:
        build = functools.partial(make_mix, mix, INSTANCES, SPLIT, prefix_cache=cache)
        t0 = time.monotonic()
        run = simulate(w, build(), MODEL, slo, rate_mode="natural", warmup_s=120.0)
        s = run.summary
        found = search_goodput(w, build, MODEL, slo, bisections=4, yardstick=Yardstick())
        point = at_goodput(found)
        row = {
            "policy": label, "mix": mix, "prefix_cache": cache,
            "hit_rate_1x": (run.config["prefix_cache"] or {}).get("hit_rate", 0.0),
            "ttft_ms_1x": [None if v is None else v * 1e3 for v in (s.ttft_p50_s, s.ttft_p90_s, s.ttft_p99_s)],
            "attainment_1x": s.slo_attainment,
            "goodput_scale": found.goodput_scale, "capped": found.capped, "non_monotone": found.non_monotone,
            "ttft_p90_ms_at_goodput": point.ttft_p90_s * 1e3 if point and point.ttft_p90_s is not None else None,
            "curve": [[p.rate_scale, p.attainment] for p in found.points],
        }
        out["policies"].append(row)
        print(f"  {trace} {label}: hit {row['hit_rate_1x']:.1%}, TTFT P50 {row['ttft_ms_1x'][0]:.0f} ms, "
              f"goodput {found.goodput_scale:.2f}x ({time.monotonic() - t0:.0f} s)", file=sys.stderr, flush=True)
    return out


def write(results: list[dict[str, Any]], command: str) -> None:
    lines = ["# Prefix cache: the traces' reuse, what a cluster keeps of it, and what dispatch makes of it", "",
             f"Command: `{command}`", "",
             f"Simulator, Llama-3.1-8B/H100 profile ({MODEL.profile.kv_capacity_tokens:,} KV tokens per engine), "
             f"{INSTANCES} instances at a fixed {SPLIT}, whole traces at natural time (first 120 s not counted); "
             "goodput: highest rate (x the trace's) with >= 90% attainment, 4 bisections. Above 1x the added "
             "requests' prefixes are namespaced per copy (`loadgen/rate_scaling.py`): hit rates there are a "
             "lower estimate.", ""]
    for r in results:
        b = r["bounds"]
        lines += [f"## {r['trace']} ({r['requests']:,} requests, {r['rate_rps']:.2f} req/s)", "",
                  f"Reuse bounds: unbounded cache {b['unbounded']:.1%}; one LRU cache of the prefill side's pooled KV "
                  f"({PREFILL_INSTANCES} engines) {b['pooled_prefill_kv']:.1%}; of one engine's KV {b['one_engine_kv']:.1%}.",
                  "", "| dispatch | engines cache | hit rate (1x) | TTFT P50 / P90 / P99 (ms, 1x) | attainment (1x) | "
                  "goodput (x) | TTFT P90 at goodput (ms) |", "|---|---|---|---|---|---|---|"]
        for p in r["policies"]:
            ttft = " / ".join("-" if v is None else f"{v:.0f}" for v in p["ttft_ms_1x"])
            gp = f"{p['goodput_scale']:.2f}" + (" (capped)" if p["capped"] else "") + (" (non-monotone)" if p["non_monotone"] else "")
            at = "-" if p["ttft_p90_ms_at_goodput"] is None else f"{p['ttft_p90_ms_at_goodput']:.0f}"
            lines.append(f"| {p['policy']} | {'yes' if p['prefix_cache'] else 'no'} | {p['hit_rate_1x']:.1%} | {ttft} | "
                         f"{p['attainment_1x']:.1%} | {gp} | {at} |")
        lines.append("")
    (OUT / "prefix_cache.md").write_text("\n".join(lines))
    (OUT / "prefix_cache.json").write_text(json.dumps({"command": command, "results": results}, indent=1))
    plot(results)


def plot(results: list[dict[str, Any]]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(results), figsize=(6 * len(results), 4.2), squeeze=False)
    for ax, r in zip(axes[0], results, strict=True):
        for p in r["policies"]:
            xs, ys = zip(*p["curve"], strict=True) if p["curve"] else ((), ())
            ax.plot(xs, [100 * y for y in ys], marker="o", label=f"{p['policy']} (hit {p['hit_rate_1x']:.0%} at 1x)")
        ax.axhline(90, color="grey", lw=0.8, ls="--")
        ax.set_title(f"{r['trace']}: reuse bound {r['bounds']['unbounded']:.0%}, "
                     f"pooled-KV LRU {r['bounds']['pooled_prefill_kv']:.0%}")
        ax.set_xlabel("rate (x the trace's, natural time)")
        ax.set_ylabel("SLO attainment (%)")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(OUT / "prefix_cache.png", dpi=110)


SPLITS = [f"{p}P{INSTANCES - p}D" for p in range(1, INSTANCES)]


def _goodput(trace: str, policy: str, cache: bool) -> tuple[str, bool, float]:
    """One goodput search: ``static-<split>``, ``colocated`` or ``poise`` (from 4P4D)."""
    if policy.startswith("static-"):
        build = functools.partial(make_mix, "static-minload", INSTANCES, policy.removeprefix("static-"),
                                  prefix_cache=cache)
    elif policy == "colocated":
        build = functools.partial(make_mix, "colocated", INSTANCES, prefix_cache=cache)
    else:
        build = functools.partial(make_mix, "poise", INSTANCES, SPLIT, prefix_cache=cache)
    found = search_goodput(load_trace(trace), build, MODEL, slo_for(trace), bisections=4, yardstick=Yardstick())
    print(f"  {trace} {policy} cache={cache}: {found.goodput_scale:.2f}x", file=sys.stderr, flush=True)
    return policy, cache, found.goodput_scale


def measure_split(traces: list[str], jobs: int) -> list[dict[str, Any]]:
    from concurrent.futures import ProcessPoolExecutor

    names = [f"static-{s}" for s in SPLITS] + ["colocated", "poise"]
    out = []
    with ProcessPoolExecutor(jobs) as pool:
        for trace in traces:
            futures = [pool.submit(_goodput, trace, n, c) for n in names for c in (False, True)]
            got = {(n, c): g for n, c, g in (f.result() for f in futures)}
            row: dict[str, Any] = {"trace": trace}
            for c in (False, True):
                best = max(SPLITS, key=lambda sp: (got[(f"static-{sp}", c)], sp))
                row["cache" if c else "no_cache"] = {
                    "static_best": got[(f"static-{best}", c)], "static_best_split": best,
                    "colocated": got[("colocated", c)], "poise": got[("poise", c)],
                    "splits": {sp: got[(f"static-{sp}", c)] for sp in SPLITS}}
            out.append(row)
    return out


def write_split(rows: list[dict[str, Any]], command: str) -> None:
    lines = ["# Prefix cache and the P:D split", "", f"Command: `{command}`", "",
             f"Simulator, {INSTANCES} instances, whole traces at natural time; goodput (x the trace's rate) at 90% "
             "attainment, 4 bisections. Poise starts at 4P4D; with the cache its split scoring and dispatch price "
             "only the uncached part of each prompt.", "",
             "| trace | engines cache | best fixed split | colocated | poise | poise / best fixed |",
             "|---|---|---|---|---|---|"]
    for r in rows:
        for key, label in (("no_cache", "no"), ("cache", "yes")):
            v = r[key]
            ratio = v["poise"] / v["static_best"] if v["static_best"] else float("nan")
            lines.append(f"| {r['trace']} | {label} | {v['static_best']:.2f}x ({v['static_best_split']}) | "
                         f"{v['colocated']:.2f}x | {v['poise']:.2f}x | {ratio:.2f}x |")
    lines.append("")
    (OUT / "prefix_cache_split.md").write_text("\n".join(lines))
    (OUT / "prefix_cache_split.json").write_text(json.dumps({"command": command, "results": rows}, indent=1))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--traces", default=",".join(TRACES))
    parser.add_argument("--part", choices=("dispatch", "split"), default="dispatch")
    parser.add_argument("--jobs", type=int, default=2)
    args = parser.parse_args()
    command = shlex.join(["python", "-m", "tests.bench.prefix_cache", *sys.argv[1:]])
    traces = args.traces.split(",")
    if args.part == "split":
        write_split(measure_split(traces, args.jobs), command)
        print(f"wrote {OUT / 'prefix_cache_split.md'}")
        return
    results = [measure(t) for t in traces]
    write(results, command)
    print(f"wrote {OUT / 'prefix_cache.md'}")


if __name__ == "__main__":
    main()
