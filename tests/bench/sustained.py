"""Sustained serving: the adaptive P:D controller against every fixed split and colocated serving, on whole
traces at natural time and on the held-out stress set (8 instances, Llama-3.1-8B/H100 profile).

The yardstick is ``loadgen.sim.goodput``'s default: the load raised at natural time (``s`` times the trace's
own rate curve), the first 120 s not counted, goodput the highest scale at which attainment there and at
every lower scale tried is >= 90%, one scale past the first failure probed for a non-monotone curve.

Which workloads parameters may be tuned on (docs/evaluation.md): ``TUNE`` (the two Azure 2023 traces); the
rest (``REPORTED``) is only reported. ``SEEN``: the two Mooncake traces and the stress set of
``loadgen/stress.py``, held out until a run here changed the controller; ``HELD_OUT``: the set of
``loadgen/heldout.py``, generated once, which no change may cite.

Per workload: every fixed split (the oracle ``static-best`` is the best of them), colocated, colocated on
Poise's engines (``colocated+poise-engines``: what Poise's colocated mode runs, without its controller), the
oracle split on Poise's engines and gateway (``static-<best>+poise-engines``, the split that was best on the
stock engines, with Poise's late binding and early rejection: Poise without its controller), and poise
starting from the even split 4P4D. Then the controller's goals are checked on the same runs:

- never below the split it starts from at a scale where that split holds >= 90% (poise is simulated at each
  such scale it was not already);
- goodput >= static-best and >= colocated (the margins are reported; the goal is 1.3x);
- at most one flip per instance in any 5 minutes, at every scale simulated;
- TTFT P99 <= 10x the SLO at every scale where the start split holds >= 95%;
- the mix simulating at >= 150 simulated seconds per wall second.

Writes ``tests/bench/results/sustained/<workload>.{md,json,png}`` and ``sustained.{md,json}`` (the summary).
The engines run the simulator's default KV model, SGLang's (decode and colocated KV grow per token and retract
when full); ``--decode-kv whole`` runs every mix with whole outputs reserved at admission instead (an oracle
that knows each output's length) and writes to ``tests/bench/results/sustained-whole/``.
``--workloads a,b`` runs some workloads and replaces their rows in the summary (each row keeps the commands
that produced it: a row re-run in part with ``--policies`` adds its command to the earlier ones); ``--jobs N``
runs N simulations at once.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import fcntl
import functools
import json
import shlex
import sys
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict
from pathlib import Path

import msgspec

from loadgen.sim.baselines import POISE_ENGINE, POISE_LATE_BINDING, PolicyMix, make_mix
from loadgen.sim.goodput import CurvePoint, GoodputResult, Yardstick, curve_point, search_goodput
from loadgen.sim.goodput_report import write_goodput_report
from loadgen.slo import SLO, slo_for
from loadgen.traces import load_trace
from shared.latency import LatencyModel, load_profile

OUT = Path("tests/bench/results")
TUNE = ["azure-code", "azure-conv"]
# Held out until a result there changed the controller (docs/evaluation.md): Mooncake conversation its capacity
# model, stress-ramp the rule that a move into colocated serving begins only while an instance can be spared,
# stress-mix-shift the rule that colocated serving is left by the TPOT it serves at, not by the model,
# and that a colocated mode failing where its load does not explain it (the step rule calls it infeasible, or
# its load fits) is left under an overload too, half the cluster a round, stress-bursts the rule that a mode
# change restarts as many instances at once as the load can spare, Mooncake synthetic the rejection of flips
# in rounds (tests/bench/results/adaptive_pd.md).
# stress-step and stress-diurnal: commit 6a43287 chose the cautious count by them.
SEEN = ["mooncake-conv", "stress-step", "stress-ramp", "stress-bursts", "stress-mix-shift", "stress-diurnal",
        "mooncake-synthetic"]
# Generated once (loadgen/heldout.py) and only ever reported: no change may cite them.
HELD_OUT = ["heldout-batch-waves", "heldout-multi-tenant", "heldout-week"]
REPORTED = SEEN + HELD_OUT  # every workload but the tuning set
INSTANCES = 8
START = "4P4D"
SPLITS = [f"{p}P{INSTANCES - p}D" for p in range(1, INSTANCES)]
TARGET = 0.9
GOAL = 1.3  # the margin over the better stock baseline
SUMMARY = OUT / "sustained" / "sustained.json"  # the SGLang-KV run's table, which later benches read
BISECTIONS = 4
#: The committed tables count requests in time (the papers' goodput) with clients that do not retry; rows
#: re-run join them on the same terms, so a summary never mixes two. `poise sim goodput` counts work, with
#: retrying clients, by default (loadgen/sim/goodput.py); these workloads on those terms are a re-run of every
#: row (docs/known-gaps.md).
YARDSTICK = Yardstick(criterion="requests", client_retries=0)
MODEL = LatencyModel(load_profile())


def model_for(max_running: int | None) -> LatencyModel:
    """The bench's latency model, with the engines' request cap replaced (``--max-running-requests``): the
    profile's 256 is DOPD's decode batch, while SGLang 0.5.23 caps a server at ``min(max(min(KV tokens /
    context length x 512, 4096), 2048), KV tokens / 2)`` unless told (2048 for this profile's pool)."""
    if max_running is None:
        return MODEL
    return LatencyModel(msgspec.structs.replace(MODEL.profile, max_running_requests=max_running), MODEL.time_scale)


# Baselines on Poise's own engines (their prefill order and preemption; ``<policy>+poise-engines``) and gateway
# rules: colocated serving (with early rejection) and the oracle fixed split (with late binding and early
# rejection).
# They tell what Poise's controller adds over its data plane, since the stock baselines run SGLang's first come
# first served and send prompts on arrival.
ON_POISE_ENGINES = "+poise-engines"
COLOCATED_POISE_ENGINES = "colocated" + ON_POISE_ENGINES
BEST_ON_POISE_ENGINES = "static-best" + ON_POISE_ENGINES  # for --policies: whichever split was best


def mix_builder(policy: str, decode_kv: str | None = None) -> Callable[[], PolicyMix]:
    """The mix this bench names ``policy``: ``static-<split>`` (least-load dispatch) or ``colocated``, either
    on Poise's engines with ``+poise-engines``, or ``poise`` (starting at 4P4D)."""
    base, on_poise_engines = policy.removesuffix(ON_POISE_ENGINES), policy.endswith(ON_POISE_ENGINES)
    engines = functools.partial(make_mix, decode_kv=decode_kv)
    if on_poise_engines:
        engines = functools.partial(engines, prefill_policy=POISE_ENGINE.prefill_policy,
                                    preemption=POISE_ENGINE.preemption, chunk_tokens=POISE_ENGINE.chunk_tokens,
                                    give_up_late=POISE_ENGINE.give_up_late)
    if base.startswith("static-"):
        if on_poise_engines:  # and Poise's gateway: the split's prefill engines get prompts as Poise's do
            assert POISE_LATE_BINDING is not None, "the Poise mix holds prompts in the gateway"
            late_binding, depth = POISE_LATE_BINDING
            engines = functools.partial(engines, late_binding=late_binding, late_binding_depth=depth,
                                        early_rejection=True)
        return functools.partial(engines, "static-minload", INSTANCES, base.removeprefix("static-"))
    if base == "colocated":
        if on_poise_engines:  # and Poise's gateway: early rejection judges colocated engines' waiting queues
            engines = functools.partial(engines, early_rejection=True)
        return functools.partial(engines, "colocated", INSTANCES)
    return functools.partial(make_mix, policy, INSTANCES, START, decode_kv=decode_kv)


def _task(workload: str, policy: str, decode_kv: str | None = None, max_running: int | None = None) -> GoodputResult:
    """One goodput search of :func:`mix_builder`'s ``policy``."""
    w = load_trace(workload)
    slo = slo_for(workload)
    build = mix_builder(policy, decode_kv)
    t0 = time.monotonic()
    result = search_goodput(w, build, model_for(max_running), slo, target=TARGET, bisections=BISECTIONS, probe_above=1,
                            yardstick=YARDSTICK)
    result.policy = policy
    print(f"  {workload} {policy}: {result.goodput_scale:.2f}x ({len(result.points)} runs, "
          f"{time.monotonic() - t0:.0f} s)", file=sys.stderr, flush=True)
    return result


def _point(workload: str, policy: str, decode_kv: str | None, max_running: int | None, scale: float) -> CurvePoint:
    return curve_point(load_trace(workload), make_mix(policy, INSTANCES, START, decode_kv=decode_kv), model_for(max_running),
                       slo_for(workload), scale, yardstick=YARDSTICK)


def _checks(start: GoodputResult, poise: GoodputResult, slo: SLO) -> dict[str, object]:
    by_scale = {p.rate_scale: p for p in poise.points}
    below = [(p.rate_scale, p.attainment, by_scale[p.rate_scale].attainment) for p in start.points
             if p.attainment >= TARGET and by_scale[p.rate_scale].attainment < p.attainment - 1e-9
             and by_scale[p.rate_scale].attainment < TARGET]
    ttft = [(p.rate_scale, by_scale[p.rate_scale].ttft_p99_s) for p in start.points if p.attainment >= 0.95]
    ttft_bad = [(s, t) for s, t in ttft if t is not None and t > 10 * slo.ttft_s]
    at = next((p for p in poise.points if p.rate_scale == poise.goodput_scale), None)
    return {
        "below_start_where_it_holds": below,
        "ttft_p99_over_10x_slo": ttft_bad,
        "max_flips_per_instance_5min": max((p.max_flips_per_instance_5min for p in poise.points), default=0),
        "flips_called_off": sum(p.flips_called_off for p in poise.points),
        # Past the cliff queues grow without bound and every mix simulates slower: the speed that matters is the
        # one where the policy is judged.
        "sim_speed_at_goodput": at.sim_speed if at is not None else None,
    }


def load_results(path: Path) -> dict[str, GoodputResult]:
    """The searches an earlier run of this bench wrote for a workload (``<workload>-all.json``)."""
    if not path.exists():
        return {}
    out = {}
    for name, r in json.loads(path.read_text()).items():
        points = [CurvePoint(**p) for p in r.pop("points")]
        out[name] = GoodputResult(**{**r, "points": points, "yardstick": Yardstick(**{"criterion": "requests", "client_retries": 0, **r["yardstick"]})})
    return out


def run_workload(workload: str, pool: ProcessPoolExecutor, out: Path, command: str,
                 only: list[str] | None = None, resume: bool = False, decode_kv: str | None = None,
                 max_running: int | None = None) -> dict[str, object]:
    """Every search of one workload; with ``only``, just those policies, the rest read from the last run; with
    ``resume``, only the searches the last run did not finish."""
    w = load_trace(workload)
    slo = slo_for(workload)
    names = [f"static-{s}" for s in SPLITS] + ["colocated", COLOCATED_POISE_ENGINES, "poise"]
    cache = out / f"{workload}-all.json"
    earlier = load_results(cache) if only is not None or resume else {}
    todo = [n for n in names if (only is not None and n in only) or n not in earlier]
    futures = {n: pool.submit(_task, workload, n, decode_kv, max_running) for n in todo}

    def best_on_poise_engines() -> tuple[str, bool]:
        """The oracle split on Poise's engines (named once the stock searches say which split is best), and
        whether to search it again."""
        best = max((results[f"static-{s}"] for s in SPLITS), key=lambda r: r.goodput_scale)
        name = f"{best.policy}{ON_POISE_ENGINES}"
        asked = only is not None and (name in only or BEST_ON_POISE_ENGINES in only)
        return name, name not in earlier or asked

    results = {n: earlier[n] for n in names if n not in futures}
    if all(f"static-{s}" in results for s in SPLITS):  # stock splits known: search it beside the others
        best_on_ours, again = best_on_poise_engines()
        if again:
            futures[best_on_ours] = pool.submit(_task, workload, best_on_ours, decode_kv, max_running)
    for n in todo:  # each search lands in the cache as it ends, so an interrupted run resumes (--resume)
        results[n] = futures[n].result()
        cache.write_text(json.dumps({k: asdict(r) for k, r in results.items()}, indent=1, default=str))
    best = max((results[f"static-{s}"] for s in SPLITS), key=lambda r: r.goodput_scale)
    best_on_ours, again = best_on_poise_engines()
    if best_on_ours in futures:
        results[best_on_ours] = futures[best_on_ours].result()
        cache.write_text(json.dumps({k: asdict(r) for k, r in results.items()}, indent=1, default=str))
    elif again:
        results[best_on_ours] = pool.submit(_task, workload, best_on_ours, decode_kv, max_running).result()
        cache.write_text(json.dumps({k: asdict(r) for k, r in results.items()}, indent=1, default=str))
    else:
        results[best_on_ours] = earlier[best_on_ours]
    names.append(best_on_ours)
    results = {n: results[n] for n in names}
    start, poise = results[f"static-{START}"], results["poise"]
    # Poise at every scale where the start split holds and poise has no point: the "never below" check.
    have = {p.rate_scale for p in poise.points}
    missing = sorted(p.rate_scale for p in start.points if p.attainment >= TARGET and p.rate_scale not in have)
    missing += sorted(p.rate_scale for p in start.points if p.attainment >= 0.95 and p.rate_scale not in have
                      and p.rate_scale not in missing)
    for _scale, point in zip(missing, pool.map(functools.partial(_point, workload, "poise", decode_kv, max_running), missing), strict=True):
        poise.points.append(point)
    poise.points.sort(key=lambda p: p.rate_scale)
    cache.write_text(json.dumps({k: asdict(r) for k, r in results.items()}, indent=1, default=str))
    oracle = dataclasses.replace(best, policy="static-best",
                                 description=f"best fixed split: {best.policy.removeprefix('static-')}")
    shown = [results[f"static-{START}"], oracle, results[best_on_ours], results["colocated"],
             results[COLOCATED_POISE_ENGINES], poise]
    write_goodput_report(shown, out, trace=workload, slo=slo, trace_rps=w.mean_rate_rps,
                         command=f"{command}  # {workload}")
    for ext in ("md", "json", "png"):
        (out / f"goodput.{ext}").rename(out / f"{workload}.{ext}")

    def ratio(a: float, b: float) -> float | None:
        return a / b if b > 0 else None

    # A goodput is known to 1/16 of the octave its search bracketed: the true one lies below the first scale
    # that failed. So Poise's ratio to the better stock baseline lies between its goodput over the baseline's
    # first failure and its first failure over the baseline's goodput.
    stock = [best, results["colocated"]]
    stock_fail = [f for f in map(_first_failing, stock) if f is not None]
    poise_fail = _first_failing(poise)
    bounds = None
    if poise_fail is not None and len(stock_fail) == len(stock):
        bounds = [ratio(poise.goodput_scale, max(stock_fail)), ratio(poise_fail, max(r.goodput_scale for r in stock))]

    return {
        "workload": workload, "set": "tune" if workload in TUNE else "seen" if workload in SEEN else "held-out", "requests": len(w),
        "duration_s": w.duration_s, "rate_rps": w.mean_rate_rps,
        "goodput": {n: r.goodput_scale for n, r in results.items()},
        "non_monotone": [n for n, r in results.items() if r.non_monotone],
        "static_best_split": best.policy.removeprefix("static-"),
        "poise_vs_static_best": ratio(poise.goodput_scale, best.goodput_scale),
        "poise_vs_colocated": ratio(poise.goodput_scale, results["colocated"].goodput_scale),
        "poise_vs_better_stock_bounds": bounds,
        "static_best_poise_engines": results[best_on_ours].goodput_scale,
        "poise_vs_best_on_poise_engines": ratio(
            poise.goodput_scale, max(results[best_on_ours].goodput_scale, results[COLOCATED_POISE_ENGINES].goodput_scale)),
        "poise_vs_start": ratio(poise.goodput_scale, start.goodput_scale),
        "checks": _checks(start, poise, slo),
    }


def better_stock_goodput(goodput: dict[str, float]) -> float:
    """The better stock baseline of a summary row's ``goodput``: the best fixed split or colocated serving, on
    SGLang's own engines."""
    return max(*(goodput[f"static-{s}"] for s in SPLITS), goodput["colocated"])


def _first_failing(r: GoodputResult) -> float | None:
    """The lowest scale above the goodput that missed the target (None: the search never failed above it)."""
    return min((p.rate_scale for p in r.points if p.rate_scale > r.goodput_scale and p.attainment < TARGET),
               default=None)


def summary_table(rows: list[dict[str, object]]) -> str:
    lines = ["| workload | set | start 4P4D | static-best (split) | its split, Poise's engines and gateway | colocated | colocated, "
             "Poise's engines | poise | poise / static-best | poise / colocated | poise / better of them, bounds "
             "| poise / best of them on its engines "
             "| below start where it holds | TTFT P99 > 10x SLO | max flips / instance / 5 min | sim speed at goodput "
             "(sim s / wall s) |", "|---" * 16 + "|"]
    for r in rows:
        g: dict[str, float] = r["goodput"]  # type: ignore[assignment]
        c: dict[str, object] = r["checks"]  # type: ignore[assignment]
        best = max(g[f"static-{s}"] for s in SPLITS)

        def fmt(x: object) -> str:
            return f"{x:.2f}x" if isinstance(x, float) else "-"

        bounds = r.get("poise_vs_better_stock_bounds")
        span = f"{bounds[0]:.2f}-{bounds[1]:.2f}" if isinstance(bounds, list) else "-"
        below = c["below_start_where_it_holds"]
        ttft = c["ttft_p99_over_10x_slo"]
        lines.append(
            f"| {r['workload']} | {r['set']} | {g[f'static-{START}']:.2f}x | {best:.2f}x ({r['static_best_split']}) | "
            f"{fmt(r.get('static_best_poise_engines'))} | {g['colocated']:.2f}x | "
            f"{fmt(g.get(COLOCATED_POISE_ENGINES))} | {g['poise']:.2f}x | "
            f"{fmt(r['poise_vs_static_best'])} | {fmt(r['poise_vs_colocated'])} | {span} | "
            f"{fmt(r.get('poise_vs_best_on_poise_engines'))} | "
            f"{below if below else 'none'} | {ttft if ttft else 'none'} | "
            f"{c['max_flips_per_instance_5min']} | {fmt(c['sim_speed_at_goodput']).rstrip('x')} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workloads", default=",".join(TUNE + REPORTED))
    parser.add_argument("--jobs", type=int, default=2)
    parser.add_argument("--policies", default=None,
                        help="re-run only these searches (static-<split>, colocated, poise, colocated+poise-engines, "
                             "static-best+poise-engines); the others are read from the workload's last "
                             "<workload>-all.json")
    parser.add_argument("--summarize", action="store_true",
                        help="run nothing: rebuild the summary rows of --workloads from their <workload>-all.json")
    parser.add_argument("--decode-kv", choices=["whole", "grow"], default=None,
                        help="the engines' KV model (default: the simulator's, SGLang's grow); whole writes to "
                             "results/sustained-whole/")
    parser.add_argument("--resume", action="store_true",
                        help="keep the searches an interrupted run already finished (<workload>-all.json)")
    parser.add_argument("--max-running-requests", type=int, default=None,
                        help="the engines' request cap instead of the profile's (a what-if: see model_for); "
                             "writes to results/sustained-mrr<N>/")
    args = parser.parse_args()
    workloads = args.workloads.split(",")
    unknown = sorted(set(workloads) - set(TUNE + REPORTED))
    if unknown:
        raise SystemExit(f"unknown workload: {', '.join(unknown)}; known: {', '.join(TUNE + REPORTED)}")
    out = OUT / ("sustained-whole" if args.decode_kv == "whole" else "sustained")
    if args.max_running_requests is not None:
        out = out.with_name(f"{out.name}-mrr{args.max_running_requests}")
    out.mkdir(parents=True, exist_ok=True)
    command = shlex.join(["python", "-m", "tests.bench.sustained", *sys.argv[1:]])
    summary = out / "sustained.json"
    kept = json.loads(summary.read_text())["rows"] if summary.exists() else []
    rows = [r for r in kept if r["workload"] not in workloads]
    produced_by = {r["workload"]: row_commands(r) for r in kept}
    t0 = time.monotonic()
    with ProcessPoolExecutor(args.jobs) as pool:
        for workload in workloads:
            print(f"{workload} ({time.monotonic() - t0:.0f} s)", file=sys.stderr, flush=True)
            only = [] if args.summarize else args.policies.split(",") if args.policies else None
            commands = commands_for_row(produced_by.get(workload, []), command, summarize=args.summarize,
                                        partial=only is not None or args.resume)
            row = {**run_workload(workload, pool, out, "; ".join(commands), only, args.resume, args.decode_kv,
                                  args.max_running_requests),
                   "commands": commands}
            with _locked(out / "sustained.lock"):  # runs on disjoint workloads may share the summary
                current = json.loads(summary.read_text())["rows"] if summary.exists() else rows
                rows = [r for r in current if r["workload"] != workload] + [row]
                order = {w: k for k, w in enumerate(TUNE + REPORTED)}
                rows.sort(key=lambda r: order[str(r["workload"])])
                summary.write_text(json.dumps({"rows": rows}, indent=1, default=str))
                _write_summary_md(out, rows, args.max_running_requests)
    print((out / "sustained.md").read_text())


def row_commands(row: dict[str, object]) -> list[str]:
    """The commands a summary row's searches came from (rows written before rows kept a list name one)."""
    commands = row.get("commands")
    return [str(c) for c in commands] if isinstance(commands, list) else [str(row["command"])]


def commands_for_row(earlier: list[str], command: str, *, summarize: bool, partial: bool) -> list[str]:
    """The commands a workload's row names after ``command`` ran: a summary keeps the row's own; a row re-run
    in part (``--policies``, ``--resume``) keeps the commands its other searches came from and adds this one;
    a whole re-run names this one alone."""
    if summarize:
        return earlier or [command]
    if partial:
        return [c for c in earlier if c != command] + [command]
    return [command]


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    with open(path, "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        yield


def _write_summary_md(out: Path, rows: list[dict[str, object]], max_running: int | None = None) -> None:
    commands = sorted({c for r in rows for c in row_commands(r)})
    (out / "sustained.md").write_text(
        "# Sustained serving: poise against every fixed split and colocated\n\nCommands (each row names its "
        "own in sustained.json): " + ", ".join(f"`{c}`" for c in commands) + "\n\n"
        f"Yardstick: {YARDSTICK.describe()}; goodput at {TARGET:.0%} attainment, 8 instances, "
        f"{BISECTIONS} bisections. Tuned on: {', '.join(TUNE)}; seen: {', '.join(SEEN)}; held out: {', '.join(HELD_OUT)}.\n\n"
        f"A goodput is known to 1/{2 ** BISECTIONS} of the octave its search bracketed: the true one lies below the "
        "first scale that failed. The bounds column is therefore Poise's goodput over the better stock baseline's "
        "first failure, and Poise's first failure over that baseline's goodput.\n\n"
        + ("KV model: whole outputs reserved at admission (an oracle that knows each output's length), not "
           "SGLang's growth per token with retraction (the simulator's default).\n\n"
           if out.name.startswith("sustained-whole") else
           "KV model: SGLang's (decode and colocated KV grow per token from prompt + 512 and retract when full).\n\n")
        + (f"Request cap: {max_running} running requests per engine, not the profile's "
           f"{MODEL.profile.max_running_requests} (a what-if: SGLang 0.5.23's own default on this KV pool is 2048; "
           "docs/known-gaps.md).\n\n" if max_running is not None else "")
        + summary_table(rows))


if __name__ == "__main__":
    main()
