"""Early rejection past capacity: the attainment-vs-rate curve with and without it, side by side in one run.

Past the decode side's capacity SGLang's first-come-first-served KV reservation makes every request wait out
the whole backlog, and a disaggregated cluster serves almost nothing in time (the sustained bench's Mooncake
conversation curves fall from 100% to 5% within 6% more load). Early rejection
(:mod:`shared.policies.admission`) refuses, with a 429, the requests the measured backlog would make late.
This bench (:mod:`tests.bench.rule_curves`) runs the oracle fixed split on Poise's engines and gateway, Poise
and colocated serving on Poise's engines, each without and with the rule, at rates from the better stock
baseline's goodput to twice it. Poise's mix keeps the rule off colocated engines, which give up late prompts
themselves; the colocated columns show what judging them would do. Writes
``tests/bench/results/early_rejection.{md,json,png}``; ``--workloads a,b`` picks workloads (default: the
two Mooncake traces and Azure code), ``--jobs N`` runs N simulations at once.
"""

from __future__ import annotations

from tests.bench.rule_curves import Rule, judge_colocated_engines, main

EARLY_REJECTION = Rule(
    name="early-rejection", keyword="early_rejection", on=True, off=False, module="tests.bench.early_rejection",
    stem="early_rejection", title="Early rejection past capacity",
    about="Cells: % of requests in time (refused ones count as misses); in brackets, % refused early. Nothing "
          "here was tuned on: the rule's parameters were set on Azure code (tune), Mooncake conversation (seen) "
          "and a synthetic long-context load (tests/unit/test_early_rejection.py).",
    workloads=("mooncake-conv", "mooncake-synthetic", "azure-code"), multiples=(1.0, 1.15, 1.3, 1.6, 2.0),
    on_colocated=judge_colocated_engines)

if __name__ == "__main__":
    main(EARLY_REJECTION)
