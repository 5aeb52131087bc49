"""DOPD's local prefill of ultra-short prompts: the rule, the dispatch wrapper, and the simulator's decode
instances prefilling in their own steps."""

from __future__ import annotations

import pytest

from loadgen.sim.baselines import make_mix
from loadgen.sim.overhead import NO_DELAY
from loadgen.sim.run import simulate
from loadgen.slo import SLO
from loadgen.workload import TraceRequest, Workload
from shared.latency import LatencyModel, load_profile
from shared.policies import LeastLoad, Placement, RequestView
from shared.policies.local_prefill import LocalPrefill, LocalPrefillParams, stays_local
from shared.policies.views import EngineView


def view(instance_id: str, role: str, *, local: bool = False, waiting: int = 0) -> EngineView:
    return EngineView(instance_id=instance_id, role=role, status="ready", kv_capacity_tokens=100_000,  # type: ignore[arg-type]
                      max_running_requests=256, waiting_reqs=waiting, load_age_s=0.0, local_prefill=local)


def req(tokens: int) -> RequestView:
    return RequestView(rid="r", input_tokens=tokens, max_output_tokens=10)


def test_the_rule_is_dynamos_conditional_disaggregation() -> None:
    p = LocalPrefillParams(max_local_prefill_tokens=512)
    assert stays_local(p, 512, None) and not stays_local(p, 513, view("p0", "prefill"))
    queued = LocalPrefillParams(max_local_prefill_tokens=512, max_prefill_queue=2)
    assert stays_local(queued, 4000, view("p0", "prefill", waiting=2))  # the prefill side is backed up
    assert not stays_local(queued, 4000, view("p0", "prefill", waiting=1))
    with pytest.raises(ValueError):
        LocalPrefillParams(max_prefill_queue=0)


def test_short_requests_go_to_the_decode_choice_alone_where_it_can_prefill() -> None:
    policy = LocalPrefill(LeastLoad())
    engines = [view("p0", "prefill"), view("d0", "decode", local=True)]
    assert policy.place(req(100), engines, 0.0) == Placement(prefill_id=None, decode_id="d0", stages=("local-prefill",))
    assert policy.place(req(5000), engines, 0.0) == Placement(prefill_id="p0", decode_id="d0")
    sglang = [view("p0", "prefill"), view("d0", "decode", local=False)]  # SGLang's PD decode cannot prefill
    assert policy.place(req(100), sglang, 0.0) == Placement(prefill_id="p0", decode_id="d0")
    assert policy.name == "least-load+local-prefill"


def test_the_simulated_decode_instance_prefills_short_prompts_itself() -> None:
    reqs = [TraceRequest(index=i, arrival_s=i * 0.05, input_tokens=200 if i % 2 else 3000, output_tokens=40)
            for i in range(80)]
    workload = Workload(name="test", requests=reqs)
    model, slo = LatencyModel(load_profile()), SLO(ttft_s=2.0, tpot_s=0.15)
    base = simulate(workload, make_mix("static-minload", 4, "2P2D"), model, slo, first_token_delay=NO_DELAY)
    local = simulate(workload, make_mix("static-minload", 4, "2P2D", local_prefill_tokens=512), model, slo,
                     first_token_delay=NO_DELAY)
    assert base.config["local_prefills"] == 0 and local.config["local_prefills"] == 40
    for result in (base, local):
        assert all(r.ok and r.output_tokens_received == r.output_tokens_expected for r in result.records)
    short = {r.index for r in reqs if r.input_tokens == 200}
    ttft = {name: sorted(r.first_token_s - r.arrival_s for r in res.records if r.index in short)
            for name, res in (("base", base), ("local", local))}
    # No KV transfer and no wait behind the 3000-token prompts on the prefill instances.
    assert ttft["local"][len(short) // 2] < ttft["base"][len(short) // 2]
