"""ARES in the simulator: predictions in the snapshot, migrations with the mechanism's stall, nothing lost."""

from __future__ import annotations

import dataclasses

import msgspec
import pytest

from loadgen.sim.baselines import make_mix
from loadgen.sim.cluster import SimCluster
from loadgen.sim.events import EventQueue
from loadgen.sim.instance import EngineSpec, SimRequest
from loadgen.sim.prediction import PredictionCadence
from loadgen.sim.run import simulate
from loadgen.slo import SLO
from loadgen.workload import TraceRequest, Workload
from shared.latency import LatencyModel, load_profile
from shared.policies import LeastLoad, MigrationDecision, NoMigration, RoundRobin
from shared.policies.length import Oracle
from shared.policies.migration_cost import KvTransfer, Recompute

SLO_ = SLO(ttft_s=5.0, tpot_s=0.05)


def model(**changes: object) -> LatencyModel:
    return LatencyModel(msgspec.structs.replace(load_profile(), **changes))


def skewed_workload() -> Workload:
    # Round-robin over 1P2D: every even request (long: 6000 tokens out) lands on d0, every odd (short) on d1.
    return Workload(name="test", requests=[
        TraceRequest(index=i, arrival_s=i * 0.5, input_tokens=2000, output_tokens=6000 if i % 2 == 0 else 300)
        for i in range(40)])


def complete_once(result: object, workload: Workload) -> bool:
    records = result.records  # type: ignore[attr-defined]
    rids = [r.rid for r in records]
    return (len(records) == len(workload.requests) and len(set(rids)) == len(rids)
            and all(r.ok and r.output_tokens_received == r.output_tokens_expected for r in records))


@pytest.mark.parametrize("migration", ["ares", "ares-oracle", "llumnix-like"])
def test_migrations_balance_a_skewed_cluster_and_lose_nothing(migration: str) -> None:
    w = skewed_workload()
    m = model()
    base_mix = dataclasses.replace(make_mix("static-rr", 3, "1P2D"), migration=NoMigration())
    base = simulate(w, base_mix, m, SLO_)
    moved = simulate(w, make_mix("static-rr", 3, "1P2D", migration=migration), m, SLO_)
    assert complete_once(base, w) and complete_once(moved, w)
    lc = moved.config["lifecycle"]
    assert lc["migrations"] >= 3 and base.config["lifecycle"]["migrations"] == 0
    balance, base_balance = moved.config["decode_balance"], base.config["decode_balance"]
    assert balance["mean_token_load_var"] < 0.5 * base_balance["mean_token_load_var"]
    assert balance["mean_step_ms_var"] < base_balance["mean_step_ms_var"]
    # the long requests share two instances' steps: the slowest request paces faster and everything ends sooner
    assert moved.summary.tpot_p99_s < base.summary.tpot_p99_s  # type: ignore[operator]
    assert moved.summary.wall_s < base.summary.wall_s
    expected = {"ares": "ares-noise", "ares-oracle": "oracle", "llumnix-like": "max-tokens"}[migration]
    assert moved.config["policies"]["length"] == expected
    assert moved.config["policies"]["migration_mechanism"] == "kv-transfer"


def cluster(m: LatencyModel, mechanism: object | None = None,
            engine: EngineSpec | None = None) -> tuple[SimCluster, EventQueue]:
    q = EventQueue()
    return SimCluster(["prefill", "decode", "decode"], m, LeastLoad(), q, mechanism=mechanism,  # type: ignore[arg-type]
                      engine=engine), q


def run(m: LatencyModel, mechanism: object, move_at_s: float | None) -> dict[str, SimRequest]:
    """Three requests round-robin over 1P2D (r0 and r2 on d0, r1 on d1); r0 moves to d1 at ``move_at_s``."""
    q = EventQueue()
    c = SimCluster(["prefill", "decode", "decode"], m, RoundRobin(), q, mechanism=mechanism)  # type: ignore[arg-type]
    reqs = {f"r{i}": SimRequest(index=i, rid=f"r{i}", arrival_s=0.0, input_tokens=4000, output_tokens=300)
            for i in range(3)}
    for req in reqs.values():
        q.at(0.0, 2, lambda req=req: c.submit(req))  # type: ignore[misc]

    def move() -> None:
        mover = reqs["r0"]
        assert mover.decode is reqs["r2"].decode and mover.decode is not reqs["r1"].decode
        assert c.migrate(MigrationDecision(rid="r0", source_id="d0", target_id="d1", reason="test"))
        # while it moves, the snapshot lists it once, on its target, as migrating
        mine = [i for i in c.decode_requests(PredictionCadence(Oracle())) if i.rid == "r0"]
        assert len(mine) == 1 and mine[0].migrating and mine[0].instance_id == "d1"
        assert mine[0].migration_source_id == "d0"
        assert mine[0].predicted_remaining_tokens == pytest.approx(300 - mover.generated, abs=1)

    if move_at_s is not None:
        q.at(move_at_s, 2, move)
    q.run()
    for inst in c.instances.values():
        assert inst.used_kv == 0 and inst.view().used_tokens == 0 and not inst.incoming and not inst.running
    assert all(r.generated == 300 and r.finished_s is not None for r in reqs.values())
    return reqs


@pytest.mark.parametrize("mechanism", ["kv-transfer", "recompute"])
def test_the_migrating_request_stalls_for_the_mechanisms_time_and_the_source_runs_on(mechanism: str) -> None:
    m = model()
    mech = KvTransfer(m) if mechanism == "kv-transfer" else Recompute(m)

    def alone(move: bool) -> tuple[SimRequest, list[int]]:
        q = EventQueue()
        c = SimCluster(["prefill", "decode", "decode"], m, LeastLoad(), q, mechanism=mech)
        req = SimRequest(index=0, rid="r0", arrival_s=0.0, input_tokens=4000, output_tokens=300)
        q.at(0.0, 2, lambda: c.submit(req))
        at_move: list[int] = []

        def go() -> None:
            at_move.append(req.generated)
            assert c.migrate(MigrationDecision(rid="r0", source_id="d0", target_id="d1", reason="test"))

        if move:
            q.at(0.5, 2, go)
        q.run()
        return req, at_move

    # alone on an instance, the move costs the request exactly the mechanism's time for its context
    (moved, at_move), (still, _) = alone(True), alone(False)
    assert moved.migrations == 1
    assert moved.finished_s - still.finished_s == pytest.approx(  # type: ignore[operator]
        mech.seconds(4000 + at_move[0]), rel=0.02)
    # with neighbours: the request left behind keeps decoding (sooner done: its batch shrank)
    base, after = run(m, mech, None), run(m, mech, 0.5)
    assert after["r0"].migrations == 1 and after["r2"].migrations == 0
    assert after["r2"].finished_s < base["r2"].finished_s  # type: ignore[operator]


def test_a_move_the_target_has_no_room_for_is_refused_and_the_request_stays() -> None:
    m = model(kv_capacity_tokens=6000)
    c, q = cluster(m)
    big = SimRequest(index=0, rid="big", arrival_s=0.0, input_tokens=4000, output_tokens=200)
    fill = SimRequest(index=1, rid="fill", arrival_s=0.0, input_tokens=4000, output_tokens=400)
    for req in (big, fill):
        q.at(0.0, 2, lambda req=req: c.submit(req))  # type: ignore[misc]
    answers: list[bool] = []

    def move() -> None:
        assert big.decode is not None and fill.decode is not None and big.decode is not fill.decode
        answers.append(c.migrate(MigrationDecision(rid="big", source_id=big.decode.instance_id,
                                                   target_id=fill.decode.instance_id, reason="test")))

    q.at(0.5, 2, move)
    q.run()
    assert answers == [False] and big.migrations == 0 and big.generated == 200 and big.finished_s is not None
    assert c.lifecycle.migrations_refused == 1 and c.lifecycle.migrations == 0


@pytest.mark.parametrize(("report", "decode_kv", "held"), [
    ("current", "whole", 1800), ("current", "grow", 1000 + 512), ("reserved", "whole", 1800)])
def test_engines_report_the_kv_written_unless_told_to_report_reservations(report: str, decode_kv: str,
                                                                          held: int) -> None:
    """A decode engine reports its requests' prompt + generated tokens, as SGLang's allocator counts them (ARES'
    baseline), whatever it reserved; ``kv_report="reserved"`` reports the reservation (an oracle)."""
    m = model()
    c, q = cluster(m, engine=EngineSpec(kv_report=report, decode_kv=decode_kv))  # type: ignore[arg-type]
    req = SimRequest(index=0, rid="r0", arrival_s=0.0, input_tokens=1000, output_tokens=800)
    q.at(0.0, 2, lambda: c.submit(req))
    seen: list[tuple[int, int, int]] = []

    def look() -> None:
        d = req.decode
        assert d is not None
        seen.append((d.used_kv, d.view().used_tokens, req.generated))

    q.at(1.0, 2, look)
    q.run()
    used, reported, generated = seen[0]
    assert used == held and 0 < generated < 512
    assert reported == (held if report == "reserved" else 1000 + generated)
    for inst in c.instances.values():
        assert inst.used_kv == 0 and inst.view().used_tokens == 0 and inst.view().inflight_tokens == 0


def test_mix_options_for_migration() -> None:
    mix = make_mix("static-minload", 6, "2P4D", migration="ares", migration_mechanism="recompute")
    assert mix.migration_mechanism == "recompute" and mix.length.name == "ares-noise" and mix.controlled
    assert "migration ares" in mix.description and "recompute" in mix.description
    bound = mix.bound(model(), __import__("shared.policies", fromlist=["PolicyContext"]).PolicyContext(
        ttft_slo_s=1.0, tpot_slo_s=0.05, max_instances=6))
    assert isinstance(bound.migration.mechanism, Recompute)  # type: ignore[union-attr]
    assert make_mix("static-minload", 6, "2P4D", migration="ares", length_predictor="oracle").length.name == "oracle"
    assert make_mix("static-minload", 6, "2P4D", migration="ares-oracle").length.name == "oracle"
    with pytest.raises(ValueError, match="known: kv-transfer, recompute"):
        make_mix("static-minload", 6, "2P4D", migration_mechanism="rdma")
    assert make_mix("static-minload", 6, "2P4D", kv_report="current").engine.kv_report == "current"
    with pytest.raises(ValueError, match="known: current, reserved"):
        make_mix("static-minload", 6, "2P4D", kv_report="max")
