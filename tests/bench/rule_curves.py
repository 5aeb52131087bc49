"""One data-plane rule of Poise's mix, on and off, along the attainment-vs-rate curve: side by side in one run.

A rule (:class:`Rule`) is one keyword of ``make_mix`` (early rejection, the gateway's late binding). The
bench runs, on the sustained yardstick (whole trace, natural time, first 120 s not counted, 8 instances), at
multiples of the better stock baseline's goodput (the best fixed split or colocated serving on SGLang's
engines, from ``tests/bench/results/sustained/sustained.json``: run that bench first):

- the oracle fixed split on Poise's engines and gateway (the sustained bench's ``+poise-engines`` split: late
  binding and early rejection), without and with the rule (what the rule does alone, beside the others);
- Poise without and with it (the rule's ``in_poise`` says which is its default);
- colocated serving on Poise's engines and gateway, and, for a rule Poise's mix keeps off colocated engines
  that give up late prompts themselves (early rejection), with it on them too.

A refused request counts as a miss, as in every attainment here. Each rule's module
(``tests.bench.early_rejection``, ``tests.bench.late_binding_kv``) is its command; ``--workloads a,b`` picks
workloads, ``--jobs N`` runs N simulations at once.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import shlex
import sys
import time
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import msgspec

from loadgen.sim.baselines import PolicyMix, make_mix
from loadgen.sim.goodput import Yardstick
from loadgen.sim.run import simulate
from loadgen.slo import slo_for
from loadgen.traces import load_trace
from tests.bench.sustained import (
    COLOCATED_POISE_ENGINES,
    INSTANCES,
    MODEL,
    OUT,
    START,
    SUMMARY,
    better_stock_goodput,
    mix_builder,
)


def judge_colocated_engines(mix: PolicyMix) -> PolicyMix:
    """``mix`` with early rejection judging colocated engines too (``EarlyRejectionParams.colocated``), which
    ``make_mix`` leaves alone when they give up late prompts themselves."""
    assert mix.early_rejection is not None
    return dataclasses.replace(mix, early_rejection=msgspec.structs.replace(mix.early_rejection, colocated=True))


@dataclass(frozen=True)
class Rule:
    """A rule of Poise's mix as ``make_mix`` turns it on (``keyword=on``) and off (``keyword=off``)."""

    name: str  # in configuration names: "early-rejection"
    keyword: str  # make_mix's keyword
    on: Any
    off: Any
    module: str  # the bench's module: its command
    stem: str  # results file stem under tests/bench/results
    title: str
    about: str  # the report's paragraph after the yardstick: what was tuned on, what the cells hold
    workloads: tuple[str, ...]
    multiples: tuple[float, ...]  # of the better stock baseline's goodput
    in_poise: bool = True  # the poise mix has the rule on by default (else it is tried on it)
    # The rule turned on for colocated engines too, where Poise's mix leaves them alone (early rejection:
    # they give up late prompts themselves): colocated serving runs with it too.
    on_colocated: Callable[[PolicyMix], PolicyMix] | None = None

    @property
    def suffix(self) -> str:
        return f"+{self.name}"

    def configurations(self, split: str) -> list[str]:
        fixed = f"static-{split}+poise-engines"
        poise = [f"poise-no-{self.name}", "poise"] if self.in_poise else ["poise", "poise" + self.suffix]
        colocated = [COLOCATED_POISE_ENGINES, self.colocated_on] if self.on_colocated else [COLOCATED_POISE_ENGINES]
        return [fixed, fixed + self.suffix, *poise, *colocated]

    @property
    def colocated_on(self) -> str:
        return COLOCATED_POISE_ENGINES + self.suffix

    def gains(self, names: list[str]) -> list[tuple[str, str, str]]:
        """(label, configuration without the rule, with it) of each gain column."""
        out = [("fixed split", names[0], names[1]), ("poise", names[2], names[3])]
        return out + ([("colocated", names[4], names[5])] if self.on_colocated else [])

    def builder(self, config: str) -> Callable[[], PolicyMix]:
        if config == "poise":
            return functools.partial(make_mix, "poise", INSTANCES, START)
        if config == f"poise-no-{self.name}":
            return functools.partial(make_mix, "poise", INSTANCES, START, **{self.keyword: self.off})
        if config == "poise" + self.suffix:
            return functools.partial(make_mix, "poise", INSTANCES, START, **{self.keyword: self.on})
        if config == self.colocated_on and self.on_colocated is not None:
            on_colocated, build = self.on_colocated, mix_builder(COLOCATED_POISE_ENGINES)
            return lambda: on_colocated(build())
        if config.startswith("static-"):
            # The split on Poise's engines and gateway (mix_builder), with the rule on or off; mix_builder's
            # factories are make_mix partials: they take make_mix's keywords.
            on = config.endswith(self.suffix)
            return functools.partial(cast(Callable[..., PolicyMix], mix_builder(config.removesuffix(self.suffix))),
                                     **{self.keyword: self.on if on else self.off})
        return mix_builder(config)


def _run(rule: Rule, workload: str, config: str, scale: float) -> dict[str, Any]:
    trace = load_trace(workload)
    y = Yardstick()
    r = simulate(trace, rule.builder(config)(), MODEL, slo_for(workload), rate_scale=scale, rate_mode=y.rate_mode,
                 warmup_s=y.warmup_for(trace, scale), seed=y.seed)
    return {"workload": workload, "config": config, "rate_scale": scale, "attainment": r.summary.slo_attainment,
            "ttft_attainment": r.summary.ttft_attainment, "requests": len(r.records),
            "early_rejections": r.config["early_rejections"],
            "refused_share": r.config["early_rejections"] / max(1, len(r.records))}


def main(rule: Rule) -> None:
    parser = argparse.ArgumentParser(description=rule.title)
    parser.add_argument("--workloads", default=",".join(rule.workloads))
    parser.add_argument("--jobs", type=int, default=2)
    args = parser.parse_args()
    if not SUMMARY.exists():
        sys.exit(f"{SUMMARY} is missing: run `python -m tests.bench.sustained` first")
    rows = {r["workload"]: r for r in json.loads(SUMMARY.read_text())["rows"]}
    workloads = [w for w in args.workloads.split(",") if w]
    unknown = [w for w in workloads if w not in rows]
    if unknown:
        sys.exit(f"no sustained row for {', '.join(unknown)} in {SUMMARY}")
    tasks = []
    for w in workloads:
        base = better_stock_goodput(rows[w]["goodput"])
        for config in rule.configurations(rows[w]["static_best_split"]):
            tasks += [(w, config, round(base * m, 4)) for m in rule.multiples]
    t0 = time.monotonic()
    results: list[dict[str, Any]] = []
    with ProcessPoolExecutor(args.jobs) as pool:
        futures = [pool.submit(_run, rule, *t) for t in tasks]
        for done, f in enumerate(as_completed(futures), 1):
            r = f.result()
            results.append(r)
            print(f"[{done}/{len(tasks)}, {time.monotonic() - t0:.0f} s] {r['workload']} {r['config']} "
                  f"{r['rate_scale']:.3g}x: {100 * r['attainment']:.1f}%", file=sys.stderr, flush=True)
    command = f"python -m {rule.module} " + " ".join(shlex.quote(a) for a in sys.argv[1:])
    meta = {"command": command.strip(), "multiples": list(rule.multiples),
            "yardstick": "whole trace, natural time, first 120 s not counted, 8 instances",
            "splits": {w: rows[w]["static_best_split"] for w in workloads},
            "sets": {w: rows[w]["set"] for w in workloads}}
    result = OUT / rule.stem
    result.with_suffix(".json").write_text(json.dumps({**meta, "points": results}, indent=1))
    result.with_suffix(".md").write_text(report(rule, meta, results, workloads))
    plot(rule, results, workloads, result.with_suffix(".png"))
    print(f"wrote {result}.{{md,json,png}}", file=sys.stderr)


def report(rule: Rule, meta: dict[str, Any], results: list[dict[str, Any]], workloads: list[str]) -> str:
    lines = [f"# {rule.title}", "",
             f"Command: `{meta['command']}`", "",
             f"Yardstick: {meta['yardstick']}. Rates: {', '.join(f'{m:g}' for m in meta['multiples'])} x the better "
             "stock baseline's goodput (the best fixed split or colocated serving on SGLang's engines, from the "
             f"sustained summary). {rule.about}", ""]
    for w in workloads:
        split = meta["splits"][w]
        names = rule.configurations(split)
        pts = {(r["config"], r["rate_scale"]): r for r in results if r["workload"] == w}
        scales = sorted({s for _, s in pts})
        gains = rule.gains(names)
        lines += [f"## {w} ({meta['sets'][w]}; oracle split {split})", "",
                  "| rate (x trace) | " + " | ".join(names) + " | "
                  + " | ".join(f"rule's gain, {label}" for label, _, _ in gains) + " |",
                  "|---" * (len(names) + len(gains) + 1) + "|"]
        for s in scales:
            cells = []
            for n in names:
                r = pts.get((n, s))
                if r is None:
                    cells.append("-")
                    continue
                refused = f" ({100 * r['refused_share']:.1f})" if r["early_rejections"] else ""
                cells.append(f"{100 * r['attainment']:.1f}{refused}")
            gain = [pts.get((b, s)) and pts.get((a, s)) and 100 * (pts[(a, s)]["attainment"] - pts[(b, s)]["attainment"])
                    for _, b, a in gains]
            lines.append(f"| {s:.4g} | " + " | ".join(cells) + " | "
                         + " | ".join("-" if g is None else f"{g:+.1f} points" for g in gain) + " |")
        lines.append("")
    return "\n".join(lines)


def plot(rule: Rule, results: list[dict[str, Any]], workloads: list[str], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(workloads), figsize=(5 * len(workloads), 4), squeeze=False)
    for ax, w in zip(axes[0], workloads, strict=True):
        mine = [r for r in results if r["workload"] == w]
        for name in dict.fromkeys(r["config"] for r in mine):
            pts = sorted((r["rate_scale"], 100 * r["attainment"]) for r in mine if r["config"] == name)
            style = "-" if name.endswith(rule.suffix) or (rule.in_poise and name == "poise") else "--"
            ax.plot(*zip(*pts, strict=True), style, marker="o", label=name)
        ax.axhline(90, color="grey", lw=0.8)
        ax.set(title=w, xlabel="rate (x trace)", ylabel="% of requests in time", ylim=(0, 102))
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
