"""The Poise mix is declared once (shared/policies/poise_mix.py) and every place that runs or describes it
reads that declaration: `poise up`, `make deploy`, the simulator's ``poise`` mix and the CLI help."""

from __future__ import annotations

import pytest

from loadgen.sim.baselines import make_mix
from services.cli.stack import StackSettings
from services.deploy.inventory import ControlPlane
from shared.latency import LatencyModel, load_profile
from shared.policies import PolicyContext
from shared.policies.poise_mix import POISE_MIX, PoiseMix
from shared.settings import load_settings


def _value(argv: list[str], flag: str) -> str:
    return argv[argv.index(flag) + 1]


@pytest.mark.parametrize("mix", [POISE_MIX, PoiseMix(prefill_policy="edf", late_binding_depth=3, dispatch_policy="least-load",
                                                      local_prefill_max_tokens=128, migration_mechanism="kv-transfer")])
def test_the_stack_and_the_simulator_run_the_declared_mix(mix: PoiseMix, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every consumer follows the declaration, so a changed declaration reaches them all."""
    import loadgen.sim.baselines as baselines
    import services.cli.stack as stack

    monkeypatch.setattr(stack, "POISE_MIX", mix)
    monkeypatch.setattr(baselines, "POISE_MIX", mix)
    live = load_settings(StackSettings)
    assert (live.dispatch_policy, live.prefill_policy, live.preemption) == (
        mix.dispatch_policy, mix.prefill_policy, mix.preemption)
    gateway = live.gateway_policy_args()
    assert _value(gateway, "--late-binding-policy") == mix.late_binding_policy and "--early-rejection" in gateway
    assert _value(gateway, "--local-prefill-max-tokens") == str(mix.local_prefill_max_tokens)
    assert _value(live.engine_args(), "--prefill-policy") == mix.prefill_policy

    sim = make_mix("poise", 4, "2P2D")
    assert sim.engine.prefill_policy == mix.prefill_policy and sim.late_binding == (
        mix.late_binding_policy, mix.late_binding_depth)
    assert sim.local_prefill is not None and sim.local_prefill.max_local_prefill_tokens == mix.local_prefill_max_tokens
    assert sim.migration_mechanism == mix.migration_mechanism and sim.drain_by_migration == mix.drain_by_migration
    bound = sim.bound(LatencyModel(load_profile()), PolicyContext(ttft_slo_s=2.0, tpot_slo_s=0.15, max_instances=4))
    assert bound.dispatch.name == mix.dispatch_policy and bound.pools is not None
    assert bound.pools.name == mix.planner_policy


def test_the_declared_mix_is_what_poise_up_and_the_simulator_run_today() -> None:
    live = load_settings(StackSettings)
    sim = make_mix("poise", 8, "4P4D")
    assert live.prefill_policy == sim.engine.prefill_policy == POISE_MIX.prefill_policy
    assert live.chunked_prefill_size == -1 and sim.engine.chunk_tokens == 0  # SGLang's "no chunks", the simulator's
    assert live.give_up_late_prompts is sim.engine.give_up_late is True
    assert (live.late_binding_policy, live.late_binding_depth) == sim.late_binding
    assert live.local_prefill_tokens() == POISE_MIX.local_prefill_max_tokens
    assert sim.early_rejection is not None and live.early_rejection


def test_the_cli_help_names_the_policies_the_mix_runs() -> None:
    help_text = StackSettings.model_fields["planner_policy"].description or ""
    assert f"--prefill-policy {POISE_MIX.prefill_policy}," in help_text
    assert f"--late-binding-policy {POISE_MIX.late_binding_policy} " in help_text


def test_make_deploy_gives_a_poise_planner_the_mixs_dispatch_unless_told() -> None:
    assert ControlPlane(node="c", planner_policy="poise").dispatch_policy == POISE_MIX.dispatch_policy
    assert ControlPlane(node="c", planner_policy="static").dispatch_policy == "least-load"
    assert ControlPlane(node="c", planner_policy="poise", dispatch_policy="round-robin").dispatch_policy == "round-robin"


@pytest.mark.parametrize(("field", "value", "message"), [
    ("prefill_policy", "fifo", "prefill policy"), ("dispatch_policy", "nearest", "dispatch policy"),
    ("late_binding_policy", "lifo", "late-binding policy"), ("preemption", "layer", "preemption"),
    ("migration_mechanism", "rdma", "migration mechanism"), ("planner_policy", "dynamo", "pool policy")])
def test_a_mix_naming_an_unknown_policy_is_refused(field: str, value: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        PoiseMix(**{field: value})


def test_the_mix_on_stock_sglang_engines_keeps_the_control_plane_and_drops_the_engine_extensions() -> None:
    from shared.policies.poise_mix import POISE_ON_SGLANG

    sim = make_mix("poise-sglang", 8, "4P4D")
    poise = make_mix("poise", 8, "4P4D")
    assert (sim.engine.prefill_policy, sim.engine.preemption, sim.engine.chunk_tokens) == ("fcfs", "chunk", None)
    assert not sim.engine.give_up_late and sim.local_prefill is None
    assert sim.early_rejection is not None and sim.early_rejection.colocated  # no engine gives up for it
    assert sim.late_binding == poise.late_binding and sim.drain_by_migration and sim.bind is not None
    assert POISE_ON_SGLANG.gateway_rules() == POISE_MIX.gateway_rules()
    assert "prefilled on decode" not in sim.description and "prefilled on decode" in poise.description
