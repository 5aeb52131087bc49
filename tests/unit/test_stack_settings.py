"""The dev stack's policy and SLO flags: validated up front, and the SLO follows the trace `poise run` replays."""

from __future__ import annotations

import pytest

from loadgen.sim.baselines import POISE_ENGINE, POISE_LATE_BINDING, make_mix
from services.cli.main import RunSettings
from services.cli.run_job import MainJobSettings
from services.cli.stack import StackSettings, one_core_each
from shared.errors import ConfigError, PoiseError
from shared.latency import load_profile
from shared.policies.admission import EarlyRejectionParams
from shared.settings import load_settings, parse_settings


def test_up_plans_for_arrow_table1_azure_conv_by_default() -> None:
    s = load_settings(StackSettings)
    assert (s.planner_policy, s.dispatch_policy) == ("poise", "arrow")
    assert s.planning_slo() == (2.0, 0.15)


def test_the_poise_planner_is_the_default_and_brings_its_mix() -> None:
    # `poise up` and `poise run` run the controller on the simulator's poise mix: Arrow's dispatch, FlowPrefill
    # engines (operator preemption, no chunks) and local prefill of short prompts.
    for s in (load_settings(StackSettings), parse_settings(RunSettings, []), parse_settings(MainJobSettings, [])):
        assert (s.planner_policy, s.dispatch_policy) == ("poise", "arrow")
        assert s.engine_args() == ["--prefill-policy", POISE_ENGINE.prefill_policy, "--preemption", "operator",
                                   "--chunked-prefill-size", "-1", "--give-up-late-prompts"]
        assert POISE_ENGINE.prefill_policy == "flowprefill-fewest-late-cautious" and POISE_ENGINE.chunk_tokens == 0
        assert POISE_ENGINE.give_up_late
        args = s.gateway_policy_args()
        assert args[args.index("--local-prefill-max-tokens") + 1] == "512" and "--early-rejection" in args
        # ... judging decode engines only: colocated ones give up late prompts themselves, as in the simulator.
        assert "--no-early-rejection-colocated" in args
        assert make_mix("poise", 8, "4P4D").early_rejection == EarlyRejectionParams(colocated=False)
        # The gateway holds prompts until a prefill engine has room, in fewest-late order (no decode shares it).
        assert args[args.index("--late-binding-policy") + 1] == POISE_LATE_BINDING[0] and "--late-binding" in args
    # --planner-policy static is the old stack: fixed roles, least-load, stock engines, no local prefill.
    static = parse_settings(StackSettings, ["--planner-policy", "static"])
    assert (static.planner_policy, static.dispatch_policy) == ("static", "least-load")
    assert static.engine_args() == [] and static.gateway_policy_args() == []
    assert "--late-binding" not in parse_settings(RunSettings, ["--no-late-binding"]).gateway_policy_args()
    assert "--give-up-late-prompts" not in parse_settings(RunSettings, ["--no-give-up-late-prompts"]).engine_args()
    stock_engines = parse_settings(RunSettings, ["--no-give-up-late-prompts"])
    assert "--no-early-rejection-colocated" not in stock_engines.gateway_policy_args()
    assert make_mix("poise", 8, "4P4D", give_up_late=False).early_rejection == EarlyRejectionParams(colocated=True)
    # What is given wins over what the planner brings.
    mine = parse_settings(RunSettings, ["--dispatch-policy", "least-load", "--prefill-policy", "fcfs",
                                        "--chunked-prefill-size", "4096"])
    assert (mine.planner_policy, mine.dispatch_policy, mine.prefill_policy) == ("poise", "least-load", "fcfs")
    assert mine.chunked_prefill_size == 4096 and mine.preemption == "operator"


def test_poise_run_replays_a_slice_whose_load_shifts_by_default() -> None:
    s = parse_settings(MainJobSettings, [])
    assert (s.trace, s.start_s, s.duration_s, s.rate_scale, s.compare) == ("stress-mix-shift", 720.0, 1080.0, 6.0, True)
    assert s.planning_slo() == (2.0, 0.15)  # the stress set is judged by Azure conversation's SLO
    assert parse_settings(MainJobSettings, ["--rate-scale", "5"]).start_s == 720.0  # a knob of the main job's slice
    # Another --trace replays from its start, 180 s at its own rate, as before (and poise bench does).
    other = parse_settings(MainJobSettings, ["--trace", "azure-code", "--no-compare"])
    assert (other.start_s, other.duration_s, other.rate_scale, other.compare) == (0.0, 180.0, 1.0, False)
    assert other.planning_slo() == (3.0, 0.1)
    # poise bench keeps its own defaults (the Azure conversation trace at its own rate).
    from services.cli.main import BenchSettings

    bench = parse_settings(BenchSettings, [])
    assert (bench.trace, bench.start_s, bench.rate_scale) == ("azure-conv", 0.0, 1.0)


def test_run_plans_for_the_traces_slo_unless_told_otherwise() -> None:
    assert parse_settings(RunSettings, ["--trace", "azure-code"]).planning_slo() == (3.0, 0.1)
    assert parse_settings(RunSettings, ["--trace", "azure-code", "--slo-tpot-s", "0.05"]).planning_slo() == (3.0, 0.05)
    assert parse_settings(RunSettings, ["--trace", "some/file.jsonl"]).planning_slo() == (2.0, 0.15)
    s = parse_settings(RunSettings, ["--planner-policy", "poise", "--dispatch-policy", "arrow"])
    assert (s.planner_policy, s.dispatch_policy) == ("poise", "arrow")


@pytest.mark.parametrize("field", ["planner_policy", "dispatch_policy"])
def test_unknown_policies_fail_before_anything_starts(field: str) -> None:
    with pytest.raises(ConfigError, match="unknown"):
        load_settings(StackSettings, **{field: "nope"})


def test_local_prefill_follows_the_dopd_based_planners_unless_set() -> None:
    # DOPD's local prefill of ultra-short prompts: on (the spec's 512 tokens) with the planners whose
    # simulated mixes keep it on, off otherwise; an explicit value, 0 included, wins.
    assert "--local-prefill-max-tokens" not in load_settings(StackSettings, planner_policy="static").gateway_policy_args()
    for policy in ("dopd", "poise"):
        args = parse_settings(RunSettings, ["--planner-policy", policy]).gateway_policy_args()
        assert args[args.index("--local-prefill-max-tokens") + 1] == "512"
    off = parse_settings(RunSettings, ["--planner-policy", "poise", "--local-prefill-max-tokens", "0"])
    assert "--local-prefill-max-tokens" not in off.gateway_policy_args()
    on = parse_settings(RunSettings, ["--planner-policy", "static", "--local-prefill-max-tokens", "256"]).gateway_policy_args()
    assert on[on.index("--local-prefill-max-tokens") + 1] == "256"


def test_early_rejection_follows_the_poise_planner_unless_set() -> None:
    # The gateway refuses requests the decode backlog would make late with the poise planner (its simulated
    # mix does), not with the others; a flag wins either way.
    assert "--early-rejection" not in parse_settings(RunSettings, ["--planner-policy", "dopd"]).gateway_policy_args()
    assert "--early-rejection" not in parse_settings(RunSettings, ["--no-early-rejection"]).gateway_policy_args()
    on = parse_settings(RunSettings, ["--planner-policy", "static", "--early-rejection"])
    assert "--early-rejection" in on.gateway_policy_args()


def test_a_migration_policy_makes_the_gateway_stream_non_streaming_legs() -> None:
    from services.gateway.config import GatewaySettings

    assert not parse_settings(GatewaySettings, load_settings(StackSettings).gateway_policy_args()).move_non_streaming
    assert not parse_settings(GatewaySettings, load_settings(StackSettings, planner_policy="static")
                              .gateway_policy_args()).move_non_streaming
    args = parse_settings(RunSettings, ["--migration-policy", "ares"]).gateway_policy_args()
    assert parse_settings(GatewaySettings, args).move_non_streaming


def test_sim_local_prefill_flag_replaces_the_mixs_rule() -> None:
    from services.cli.main import SimSettings

    assert parse_settings(SimSettings, []).mix_builder("poise")().local_prefill is not None  # the mix's default
    assert parse_settings(SimSettings, ["--local-prefill-max-tokens", "0"]).mix_builder("poise")().local_prefill is None
    mix = parse_settings(SimSettings, ["--local-prefill-max-tokens", "300"]).mix_builder("static-minload")()
    assert mix.local_prefill is not None and mix.local_prefill.max_local_prefill_tokens == 300


def test_sim_drain_by_migration_flag_replaces_the_mixs_default() -> None:
    from services.cli.main import SimSettings

    assert parse_settings(SimSettings, []).mix_builder("poise")().drain_by_migration  # the mix's default
    off = parse_settings(SimSettings, ["--no-drain-by-migration"]).mix_builder("poise")()
    assert not off.drain_by_migration and "decode drains wait for their answers" in off.description
    assert parse_settings(SimSettings, ["--drain-by-migration"]).mix_builder("static-minload")().drain_by_migration


def test_sim_late_binding_flag_replaces_the_mixs_queue() -> None:
    from services.cli.main import SimSettings

    # Poise's mix holds prompts in the gateway in its engines' order (SGLang's decode side reserves KV at dispatch).
    assert parse_settings(SimSettings, []).mix_builder("poise")().late_binding == (POISE_LATE_BINDING[0], 2)
    off = parse_settings(SimSettings, ["--late-binding", "none"]).mix_builder("poise")()
    assert off.late_binding is None and "late binding none" in off.description
    assert parse_settings(SimSettings, []).mix_builder("static-minload")().late_binding is None


def test_the_live_comparison_simulates_the_late_binding_the_stack_ran() -> None:
    from loadgen.sim.baselines import make_mix
    from services.cli.run_job import simulated_poise_overrides

    def simulated(argv: list[str]) -> tuple[str, int] | None:
        overrides = simulated_poise_overrides(parse_settings(RunSettings, argv))
        return make_mix("poise", 4, "2P2D", **{k: v for k, v in overrides.items() if v is not None}).late_binding

    assert simulated([]) == (POISE_LATE_BINDING[0], 2)
    overrides = simulated_poise_overrides(parse_settings(RunSettings, ["--no-give-up-late-prompts"]))
    assert make_mix("poise", 4, "2P2D", **{k: v for k, v in overrides.items() if v is not None}).engine.give_up_late is False
    assert simulated_poise_overrides(parse_settings(RunSettings, []))["give_up_late"] is True
    assert simulated(["--no-late-binding"]) is None
    assert simulated(["--late-binding-policy", "edf", "--late-binding-depth", "3"]) == ("edf", 3)


def test_sim_decode_kv_flag_picks_the_kv_model() -> None:
    from services.cli.main import SimSettings

    assert parse_settings(SimSettings, []).mix_builder("static-minload")().engine.decode_kv == "grow"  # SGLang's
    assert parse_settings(SimSettings, ["--decode-kv", "whole"]).mix_builder("static-minload")().engine.decode_kv == "whole"
    with pytest.raises(PoiseError, match="decode KV model"):
        parse_settings(SimSettings, ["--decode-kv", "paged"]).mix_builder("static-minload")


def test_sim_policy_help_names_every_mix() -> None:
    """The help lists the mixes by hand (the CLI does not import the simulator to print it): it must not drift."""
    import re

    from loadgen.sim.baselines import MIXES
    from services.cli.main import SimSettings

    description = SimSettings.model_fields["policy"].description or ""
    listed = set(re.findall(r"[a-z][a-z-]+", description.split(":", 1)[1]))
    assert set(MIXES) <= listed, f"missing from --policy's help: {sorted(set(MIXES) - listed)}"


def test_poise_sim_on_a_whole_trace_replays_the_trace_the_benchmarks_load() -> None:
    """No re-basing of a whole trace: a stress trace's first request arrives after 0, and shifting every arrival
    would change the natural rate mode's draws, so `poise sim` would not reproduce a benchmark's point."""
    from loadgen.traces import load_trace
    from services.cli.main import SimSettings
    from services.cli.replay_job import select_workload

    trace = load_trace("stress-bursts")
    assert trace.requests[0].arrival_s > 0
    assert select_workload(parse_settings(SimSettings, ["--trace", "stress-bursts"])).requests == trace.requests
    part = select_workload(parse_settings(SimSettings, ["--trace", "stress-bursts", "--duration-s", "60"]))
    assert part.requests[0].arrival_s == 0.0  # a slice still starts at its first request


def test_sglang_cpu_engines_bring_their_model_and_wait_and_no_engine_sim_flags() -> None:
    s = load_settings(StackSettings, engines="sglang-cpu")
    assert s.model == "SmolLM2-135M-Instruct" and s.ready_timeout_s == 900.0
    # The policies plan with the preset's own fitted profile and an SLO a CPU pair can meet, not an H100's.
    assert s.profile == "smollm2-135m-cpu" and load_profile(s.profile).model == s.model
    assert s.planning_slo() == (4.0, 0.3)
    assert load_settings(StackSettings, engines="sglang-cpu", slo_ttft_s=9).planning_slo() == (9.0, 0.3)
    assert s.engine_args() == []  # SGLang runs its own scheduling: FlowPrefill etc. are engine_sim's
    assert "--no-early-rejection-colocated" not in s.gateway_policy_args()  # SGLang engines do not give up
    # A CPU engine's /health waits out a prefill pass of seconds: the gateway's probe gives it that long.
    args = s.gateway_policy_args()
    assert float(args[args.index("--probe-timeout-s") + 1]) >= 30
    assert one_core_each(3, 2) == {"SGLANG_CPU_OMP_THREADS_BIND": "1", "OMP_NUM_THREADS": "1"}
    sim = load_settings(StackSettings)
    assert "--probe-timeout-s" not in sim.gateway_policy_args()
    assert sim.model == "meta-llama/Llama-3.1-8B-Instruct" and sim.ready_timeout_s == 60.0 and sim.engine_args()
    assert sim.profile == "llama-3.1-8b-h100" and sim.planning_slo() == (2.0, 0.15)
    assert load_settings(StackSettings, engines="sglang-cpu", model="m", ready_timeout_s=5).model == "m"
