"""Emptying a decode instance by migration: the migrator's plan (shared.policies.evacuation) and the simulator
running it for the controller's flips."""

from __future__ import annotations

import dataclasses

import msgspec
import pytest

from loadgen.sim.baselines import make_mix
from loadgen.sim.cluster import SimCosts
from loadgen.sim.overhead import NO_DELAY
from loadgen.sim.run import simulate
from loadgen.slo import SLO
from loadgen.workload import TraceRequest, Workload
from shared.latency import LatencyModel, load_profile
from shared.policies.evacuation import Evacuation, evacuation_done, evacuation_moves
from shared.protocol.messages import ClusterSnapshot, DecodeRequestInfo, InstanceInfo, InstanceLoad, LoadReport
from tests.unit.test_sim_control import FlipOnce


def decode(i: str, *, used: int = 0, capacity: int = 100_000, waiting: int = 0, status: str = "ready") -> InstanceLoad:
    info = InstanceInfo(instance_id=i, role="decode", status=status, engine_kind="sim", url="sim://x",  # type: ignore[arg-type]
                        bootstrap_host="", bootstrap_port=None, model="m", profile="p", kv_capacity_tokens=capacity,
                        max_running_requests=256, sidecar="sim", registered_at_unix_s=0.0)
    load = LoadReport(instance_id=i, role="decode", status=status, ts_unix_s=0.0,  # type: ignore[arg-type]
                      num_used_tokens=used, max_total_num_tokens=capacity, num_waiting_reqs=waiting)
    return InstanceLoad(info=info, load=load, load_age_s=0.0)


def running(rid: str, on: str, prompt: int, generated: int = 0, max_output: int = 1000) -> DecodeRequestInfo:
    return DecodeRequestInfo(rid=rid, instance_id=on, input_tokens=prompt, generated_tokens=generated,
                             max_output_tokens=max_output, arrived_unix_s=0.0)


def test_moves_go_longest_first_to_the_least_loaded_target_with_room() -> None:
    snap = ClusterSnapshot(ts_unix_s=0.0, series=[], instances=[
        decode("src", status="draining"), decode("a", used=10_000), decode("b", used=95_000), decode("c", used=0)],
        decode_requests=[running("r1", "src", 20_000), running("r2", "src", 30_000), running("r3", "src", 5_000),
                         running("x", "a", 10_000)])
    moves = evacuation_moves(snap, "src")
    # b (5K free) fits none of them; c (empty) takes the longest, a the next, and then both hold 30K: the tie
    # goes by name.
    assert [(m.rid, m.target_id) for m in moves] == [("r2", "c"), ("r1", "a"), ("r3", "a")]
    assert all(m.source_id == "src" for m in moves)


def test_a_request_that_fits_nowhere_waits_for_a_later_round() -> None:
    full = [decode("src", status="draining"), decode("a", used=99_000), decode("b", used=99_500)]
    snap = ClusterSnapshot(ts_unix_s=0.0, series=[], instances=full,
                           decode_requests=[running("r1", "src", 2_000, generated=100)])
    assert evacuation_moves(snap, "src") == []
    assert not evacuation_done(snap, "src", [])  # it is still there: the next round tries again
    assert evacuation_done(snap, "src", [], skip=frozenset({"r1"}))  # a move that failed stays put


@pytest.mark.parametrize(("generated", "max_output", "fits"), [
    (50, 500, True),  # 450 of context + the 450 tokens it has left to write <= a's 1,000 free
    (50, 5_000, False),  # 550 + SGLang's 512 reserved > 1,000
])
def test_the_room_a_move_needs_counts_what_the_target_reserves_for_its_next_tokens(
        generated: int, max_output: int, fits: bool) -> None:
    prompt = 400 if max_output == 500 else 500
    snap = ClusterSnapshot(ts_unix_s=0.0, series=[], instances=[decode("src", status="draining"),
                                                                 decode("a", used=99_000)],
                           decode_requests=[running("r", "src", prompt, generated=generated, max_output=max_output)])
    assert [m.target_id for m in evacuation_moves(snap, "src")] == (["a"] if fits else [])


def test_requests_waiting_on_the_source_keep_the_evacuation_going() -> None:
    snap = ClusterSnapshot(ts_unix_s=0.0, series=[], instances=[decode("src", status="draining", waiting=3),
                                                                 decode("a")], decode_requests=[])
    assert not evacuation_done(snap, "src", [])
    idle = ClusterSnapshot(ts_unix_s=0.0, series=[], instances=[decode("src", status="draining"), decode("a")],
                           decode_requests=[])
    assert evacuation_done(idle, "src", [])


def test_a_target_that_reports_no_capacity_is_not_limited() -> None:
    snap = ClusterSnapshot(ts_unix_s=0.0, series=[], instances=[decode("src", status="draining"),
                                                                 decode("a", capacity=0)],
                           decode_requests=[running("r1", "src", 50_000)])
    assert [m.target_id for m in evacuation_moves(snap, "src")] == ["a"]


def long_answers(n: int, output: int) -> Workload:
    return Workload(name="long", requests=[TraceRequest(index=i, arrival_s=0.1 * i, input_tokens=1000,
                                                        output_tokens=output) for i in range(n)])


@pytest.mark.parametrize("by_migration", [False, True])
def test_the_simulator_empties_a_busy_decode_instance_by_migration_and_loses_nothing(by_migration: bool) -> None:
    # Answers of 6,000 tokens take about a minute at ~10 ms a step: past a 10 s drain deadline.
    work = long_answers(12, 6_000)
    flip = FlipOnce("d0", "prefill", at_s=5.0)
    mix = dataclasses.replace(make_mix("static-minload", 4, "1P3D"), pools=flip, drain_by_migration=by_migration,
                              migration_mechanism="recompute")
    result = simulate(work, mix, LatencyModel(load_profile()), SLO(ttft_s=2.0, tpot_s=0.15),
                      first_token_delay=NO_DELAY, costs=SimCosts(drain_timeout_s=10.0))
    assert all(r.ok and r.output_tokens_received == r.output_tokens_expected for r in result.records)
    lifecycle = result.config["lifecycle"]
    if not by_migration:
        assert lifecycle["flips_called_off"] == 1 and lifecycle["flips"] == 0 and lifecycle["migrations"] == 0
        return
    assert lifecycle["flips"] == 1 and lifecycle["flips_called_off"] == 0
    assert lifecycle["migrations"] == 4  # d0's share of the twelve answers
    # Drained in about one re-prefill of a 1K-token context (plus the half second before the first round).
    back = next(t for t, who, what in lifecycle["events"] if who == "d0" and what == "switching")
    assert 5.0 < back < 5.0 + 2.0


def test_the_planner_tells_its_pool_policy_how_draining_decode_instances_are_emptied() -> None:
    from services.planner.config import PlannerSettings
    from shared.settings import load_settings

    assert load_settings(PlannerSettings).pool_policy_context().drain_migration == "recompute"
    assert load_settings(PlannerSettings, drain_mechanism="kv-transfer").pool_policy_context().drain_migration == \
        "kv-transfer"
    assert load_settings(PlannerSettings, drain_by_migration=False).pool_policy_context().drain_migration is None
    with pytest.raises(ValueError, match="unknown migration mechanism"):
        load_settings(PlannerSettings, drain_mechanism="teleport")


def test_an_evacuation_runs_rounds_until_nothing_is_left_or_its_deadline_passed() -> None:
    """The rounds the migrator runs live and the simulator on its clock (``Evacuation``)."""
    instances = [decode("src", status="draining"), decode("a", used=99_000)]
    stuck = ClusterSnapshot(ts_unix_s=0.0, series=[], instances=instances,
                            decode_requests=[running("r1", "src", 2_000, generated=100)])
    evacuation = Evacuation("src", deadline_s=10.0)
    assert evacuation.round(stuck, 1.0) == []  # fits nowhere yet: a later round tries again
    assert evacuation.round(stuck, 10.0) is None  # the drain's deadline: the flip is called off
    roomy = msgspec.structs.replace(stuck, instances=[decode("src", status="draining"), decode("a")])
    [move] = evacuation.round(roomy, 2.0) or []
    assert (move.rid, move.target_id) == ("r1", "a")
    evacuation.failed("r1")  # the move failed: later rounds leave it where it is
    assert evacuation.round(roomy, 2.2) is None
