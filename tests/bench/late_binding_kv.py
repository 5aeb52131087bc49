"""Late binding for the decode KV: the attainment-vs-rate curve with and without the gateway's prompt queue.

SGLang's decode side reserves a request's KV when the request is dispatched, before its prefill starts (the
prealloc queue). With prompts sent to prefill engines on arrival, every prompt queued at a prefill engine holds
its decode KV while it waits, and past the prefill side's capacity the decode pools fill with prompts not yet
computed: the decode side refuses or queues requests it has the compute for. Late binding
(:mod:`shared.policies.late_binding`) holds prompts in the gateway and sends one to a prefill engine only when
that engine has fewer than ``depth`` unprefilled, so a prompt holds decode KV only from shortly before its
prefill. With early rejection on (Poise's mix) it also guards the decode side (``LateBinding.guard_decode``).
Poise's mix runs it by default.

This bench (:mod:`tests.bench.rule_curves`) runs the oracle fixed split on Poise's engines and gateway and Poise, each
without and with it, and colocated serving on Poise's engines, at rates from the better stock baseline's
goodput to twice it. Writes ``tests/bench/results/late_binding_kv.{md,json,png}``; ``--workloads a,b`` picks
workloads, ``--jobs N`` runs N simulations at once.
"""

from __future__ import annotations

from shared.policies import POISE_LATE_BINDING_POLICY
from tests.bench.rule_curves import Rule, main

LATE_BINDING = Rule(
    name="late-binding", keyword="late_binding", on=POISE_LATE_BINDING_POLICY, off="none",
    module="tests.bench.late_binding_kv", stem="late_binding_kv", title="Late binding and the decode KV",
    about="Cells: % of requests in time (refused ones count as misses); in brackets, % refused early (Poise's "
          "early rejection and late binding's give-up). Late binding holds prompts in the gateway in FlowPrefill's "
          "order (the engines' own), depth 2 (the gateway's default, not tuned); with Poise's early rejection it "
          "also guards the decode side (LateBinding.guard_decode). The fixed split has early rejection too. Found on "
          "Azure code (tune); the other two workloads are only reported.",
    workloads=("azure-code", "mooncake-conv", "mooncake-synthetic"), multiples=(1.0, 1.3, 1.6, 2.0))

if __name__ == "__main__":
    main(LATE_BINDING)
