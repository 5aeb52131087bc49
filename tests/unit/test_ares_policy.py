"""ARES Algorithm 1 (shared/policies/ares.py): classification, filters, the objective, selection, guards."""

from __future__ import annotations

import itertools
import random

import pytest

from shared.latency import LatencyModel, load_profile
from shared.policies import MigrationPolicy, make_migration_policy
from shared.policies.ares import AresMigration, AresParams, AresState, Inst, Req, alive_steps, step_weights
from shared.protocol.messages import ClusterSnapshot, DecodeRequestInfo, InstanceInfo, InstanceLoad, LoadReport

MODEL = LatencyModel(load_profile())
_check: MigrationPolicy = AresMigration()


class FixedCost:
    """A migration mechanism with a constant cost, so tests control the delay and the cost filter."""

    name = "fixed"

    def __init__(self, seconds: float) -> None:
        self.s = seconds

    def seconds(self, tokens: int) -> float:
        return self.s


def snapshot(loads: dict[str, list[tuple[str, int, float]]], *, capacity: int = 10_000_000, step_s: float = 0.02,
             used: dict[str, int] | None = None, migrating: dict[str, str] | None = None) -> ClusterSnapshot:
    """Decode instances with requests (rid, context tokens, predicted remaining); every instance steps in
    ``step_s``. ``migrating``: rid -> source id, for requests listed on their target mid-migration."""
    instances, reqs = [], []
    for iid, items in loads.items():
        info = InstanceInfo(instance_id=iid, role="decode", engine_kind="sim", url="", bootstrap_host="",
                            bootstrap_port=None, model="m", profile=MODEL.profile.name, kv_capacity_tokens=capacity,
                            max_running_requests=256, sidecar="", registered_at_unix_s=0.0)
        running = len(items)
        load = LoadReport(instance_id=iid, role="decode", status="ready", ts_unix_s=0.0, num_running_reqs=running,
                          num_used_tokens=(used or {}).get(iid, sum(n for _, n, _ in items)),
                          max_total_num_tokens=capacity, gen_throughput_tps=running / step_s if running else 0.0)
        instances.append(InstanceLoad(info=info, load=load, load_age_s=0.0))
        for rid, tokens, remaining in items:
            source = (migrating or {}).get(rid)
            reqs.append(DecodeRequestInfo(rid=rid, instance_id=iid, input_tokens=tokens, generated_tokens=0,
                                          max_output_tokens=100_000, arrived_unix_s=0.0,
                                          predicted_remaining_tokens=remaining, migrating=source is not None,
                                          migration_source_id=source))
    return ClusterSnapshot(ts_unix_s=0.0, instances=instances, series=[], decode_requests=reqs)


def policy(cost_s: float = 0.1, **params: object) -> AresMigration:
    return AresMigration(AresParams(**params), MODEL, FixedCost(cost_s))  # type: ignore[arg-type]


def test_weights_are_normalised_and_decay() -> None:
    w = step_weights(30, 0.9)
    assert w[0] == 1.0 and sum(w[1:]) == pytest.approx(1.0)
    assert all(a > b for a, b in itertools.pairwise(w[1:]))
    assert step_weights(0, 0.9) == [1.0]
    assert alive_steps(1, 50, 30) == 1 and alive_steps(100, 50, 30) == 2 and alive_steps(101, 50, 30) == 3
    assert alive_steps(10**9, 50, 30) == 31


@pytest.mark.parametrize(("rule", "under"), [("paper", ["d0", "d1", "d2"]), ("strict", ["d0", "d1"])])
def test_classification_rules_on_current_loads(rule: str, under: list[str]) -> None:
    # Llumnix-like: w = current load. Loads 100/200/300/600 -> mean 300; theta 0.1: O = loads > 330.
    p = policy(mode="current_only", underload_rule=rule)
    snap = snapshot({"d0": [("a", 100, 5)], "d1": [("b", 200, 5)], "d2": [("c", 300, 5)], "d3": [("d", 600, 5)]})
    state = p.state(snap, 0.0)
    assert state is not None
    over, low = p.classify(state)
    assert [i.instance_id for i in over] == ["d3"]
    # paper: current load < 1.1 x mean (330), strict: < 0.9 x mean (270); least loaded first
    assert [i.instance_id for i in low] == under


def test_predicted_classification_sees_the_future_and_keeps_o_out_of_u() -> None:
    # 50 tokens per step. d0 holds little now (10 x 100 tokens) but grows fast (10 requests running on):
    # w_0 = 1000 + 500 k weighted ~ 5.1K; d1, d2 hold 2 x 1000 and grow slowly: w ~ 2.8K; w_bar ~ 3.6K.
    p = policy(delta_tokens=50)
    snap = snapshot({"d0": [(f"a{i}", 100, 50_000.0) for i in range(10)],
                     "d1": [("c", 1000, 50_000.0), ("d", 1000, 50_000.0)],
                     "d2": [("e", 1000, 50_000.0), ("f", 1000, 50_000.0)]})
    state = p.state(snap, 0.0)
    assert state is not None
    over, under = p.classify(state)
    assert [i.instance_id for i in over] == ["d0"]
    # paper rule: d0's current load (1000) is under 1.1 x w_bar, but a member of O is never in U
    assert {i.instance_id for i in under} == {"d1", "d2"}
    (move,) = p.select(snap, 0.0)
    assert move.source_id == "d0" and move.target_id in {"d1", "d2"}


def test_paper_underload_rule_compares_current_loads_with_the_future_average() -> None:
    # Equal current loads; d0's requests run on, the others' end within two steps. The future average is far
    # below every current load, so Algorithm 1 as printed finds no underloaded instance and moves nothing.
    p = policy(delta_tokens=50)
    snap = snapshot({"d0": [("a", 1000, 50_000.0), ("b", 1000, 50_000.0)],
                     "d1": [("c", 1000, 60.0), ("d", 1000, 60.0)], "d2": [("e", 1000, 60.0), ("f", 1000, 60.0)]})
    state = p.state(snap, 0.0)
    assert state is not None
    over, under = p.classify(state)
    assert [i.instance_id for i in over] == ["d0"] and under == []
    assert p.select(snap, 0.0) == []


def brute_objective(insts: list[Inst], horizon: int, omega: list[float], step_s: float,
                    move: tuple[Req, Inst, Inst, float] | None = None) -> float:
    """Eq. 4 truncated at H, step by step: every trajectory built explicitly, every variance summed."""
    n = len(insts)
    total = 0.0
    for k in range(horizon + 1):
        loads = []
        for inst in insts:
            x = sum(r.tokens + k * inst.delta for r in inst.reqs
                    if (move is None or r is not move[0]) and k * inst.delta < r.remaining)
            if move is not None and inst is move[2]:
                req, _, target, delay = move
                m = delay / step_s
                if k == 0:
                    x += req.tokens
                elif k >= m and (k - m) * target.delta < req.remaining:
                    x += req.tokens + (k - m) * target.delta
            loads.append(x)
        mean = sum(loads) / n
        total += omega[k] * sum((v - mean) ** 2 for v in loads) / n
    return total


def test_incremental_objective_equals_brute_force_on_random_states() -> None:
    rng = random.Random(7)
    for _ in range(150):
        horizon = rng.choice([0, 1, 4, 30])
        insts = [Inst(f"d{i}", [Req(f"r{i}-{j}", rng.randint(10, 40_000),
                                    float(rng.choice([1, rng.randint(2, 500), rng.uniform(1, 30_000)])), True)
                                for j in range(rng.randint(0, 8))],
                      0.02, float(rng.choice([1, 20, 57, 137])), 10**7, 0, False) for i in range(rng.randint(2, 7))]
        omega = step_weights(horizon, 0.9)
        state = AresState(insts, horizon, omega, 1.0)
        base = brute_objective(insts, horizon, omega, 1.0)
        assert state.objective() == pytest.approx(base, rel=1e-9, abs=1e-6)
        for _ in range(8):
            source = rng.choice([i for i in insts if i.reqs] or [None])
            if source is None:
                break
            target = rng.choice([i for i in insts if i is not source])
            req = rng.choice(source.reqs)
            delay = rng.choice([0.0, 0.4, 1.0, 2.5, 9.0])
            after = brute_objective(insts, horizon, omega, 1.0, (req, source, target, delay))
            assert state.reduction(req, source, target, delay) == pytest.approx(base - after, rel=1e-9, abs=1e-3)


def random_snapshot(rng: random.Random, n: int) -> ClusterSnapshot:
    loads = {f"d{i}": [(f"r{i}-{j}", rng.randint(100, 30_000), float(rng.randint(1, 30_000)))
                       for j in range(rng.randint(1, 10))] for i in range(n)}
    return snapshot(loads)


@pytest.mark.parametrize("mode", ["predicted", "current_only"])
def test_selection_picks_the_largest_reduction_among_filtered_candidates(mode: str) -> None:
    rng = random.Random(3)
    for _ in range(20):
        snap = random_snapshot(rng, rng.randint(2, 6))
        p = policy(mode=mode, max_sources=0, max_targets=0, min_reduction_frac=0.0)
        state = p.state(snap, 0.0)
        assert state is not None
        over, under = p.classify(state)
        best = 0.0
        for s, t in itertools.product(over, under):
            for r in p.requests(s, 0.0):
                if mode == "predicted" and r.remaining <= 0.1 / s.t_exec_s:
                    continue
                if state.fits(r, t, 0.1, 0.9, mode == "predicted"):
                    best = max(best, state.reduction(r, s, t, 0.1))
        moves = p.select(snap, 0.0)
        if best <= 1e-9:
            assert moves == []
            continue
        (move,) = moves
        fresh = policy(mode=mode).state(snap, 0.0)
        assert fresh is not None
        chosen = next(r for r in policy().requests(fresh.insts[move.source_id], 0.0) if r.rid == move.rid)
        gain = fresh.reduction(chosen, fresh.insts[move.source_id], fresh.insts[move.target_id], 0.1)
        assert gain == pytest.approx(best)


def test_no_move_when_balanced_or_below_epsilon() -> None:
    balanced = snapshot({f"d{i}": [(f"r{i}", 5000, 3000.0)] for i in range(4)})
    assert policy().select(balanced, 0.0) == []
    slight = snapshot({"d0": [("a", 5400, 3000.0), ("x", 10, 5.0)], "d1": [("b", 5000, 3000.0)],
                       "d2": [("c", 5000, 3000.0)], "d3": [("d", 4600, 3000.0)]})
    # the only helpful move is the 10-token request, far below 1% of the objective
    assert policy().select(slight, 0.0) == []


def skewed() -> ClusterSnapshot:
    return snapshot({"d0": [("big", 20_000, 20_000.0), ("b2", 20_000, 20_000.0), ("b3", 20_000, 20_000.0)],
                     "d1": [("s1", 2000, 20_000.0)], "d2": [("s2", 2000, 20_000.0)]})


def test_cost_filter_skips_requests_that_finish_before_the_move_pays() -> None:
    # T_exec = 0.02 s: a 30 s move costs 1,500 iterations, less than the 20,000 tokens every request has left;
    # a 500 s move costs 25,000, more than any has left.
    assert policy(cost_s=30.0).select(skewed(), 0.0)
    assert policy(cost_s=500.0).select(skewed(), 0.0) == []
    assert policy(cost_s=500.0, mode="current_only").select(skewed(), 0.0)  # llumnix-like has no cost filter


def growing(capacity: int) -> ClusterSnapshot:
    # d1 and d2 hold 10K tokens now in 20 requests that keep running: 10K + 20 x 50 x 30 = 40K at the horizon.
    # A 3K-token request from d0 adds 3K + ~1.5K there: 44.5K, over C_mem = 0.9 x 45K but within 60K x 0.9.
    # Their reported use (10K) + N(r) + N_hat(r) = 33K fits either capacity.
    return snapshot({"d0": [("a", 20_000, 20_000.0), ("b", 17_000, 20_000.0), ("r", 3000, 20_000.0)],
                     "d1": [(f"x{i}", 500, 20_000.0) for i in range(20)],
                     "d2": [(f"y{i}", 500, 20_000.0) for i in range(20)]}, capacity=capacity)


def test_memory_filter_uses_the_horizon_and_the_requests_own_tokens() -> None:
    assert policy().select(growing(60_000), 0.0)
    assert policy().select(growing(45_000), 0.0) == []
    # Llumnix-like checks only the current load plus N(r): 10K + 3K..20K fits 40.5K
    assert policy(mode="current_only").select(growing(45_000), 0.0)
    # N(r) itself: 9K on a target holding 1K, C_mem = 9K: nothing fits in any mode (the paper's check, with
    # N_hat alone, would have let the 100-token remainder through)
    tiny = snapshot({"d0": [("a", 9000, 100.0), ("b", 9000, 100.0)], "d1": [("c", 1000, 100.0)]},
                    capacity=10_000, used={"d0": 18_000, "d1": 1000})
    assert policy(mode="current_only").select(tiny, 0.0) == []
    assert policy().select(tiny, 0.0) == []


def test_cooldown_and_in_flight_guards() -> None:
    p = policy(cooldown_s=10.0)
    (first,) = p.select(skewed(), 0.0)
    assert first.source_id == "d0"
    # the same snapshot again (the move not carried out): the moved request is cooling down, another goes
    (second,) = p.select(skewed(), 5.0)
    assert second.rid != first.rid
    (third,) = p.select(skewed(), 20.0)
    assert third.rid == first.rid
    # a migration in flight from d0 to d1: neither d0 nor d1 takes part, and the migrating request stays put
    snap = snapshot({"d0": [("b2", 20_000, 20_000.0), ("b3", 20_000, 20_000.0), ("b4", 20_000, 20_000.0)],
                     "d1": [("s1", 2000, 20_000.0), ("big", 20_000, 20_000.0)], "d2": [("s2", 2000, 20_000.0)],
                     "d3": [("s3", 2000, 20_000.0)]}, migrating={"big": "d0"})
    moves = policy().select(snap, 0.0)
    assert all(m.source_id not in ("d0", "d1") and m.target_id not in ("d0", "d1") for m in moves)
    assert all(m.rid != "big" for m in moves)


def test_several_moves_per_round_use_distinct_instances() -> None:
    snap = snapshot({"d0": [(f"a{i}", 20_000, 20_000.0) for i in range(3)],
                     "d1": [(f"b{i}", 20_000, 20_000.0) for i in range(3)],
                     "d2": [("c", 1000, 20_000.0)], "d3": [("d", 1000, 20_000.0)]})
    moves = policy(max_migrations_per_round=3).select(snap, 0.0)
    assert len(moves) == 2
    used = [m.source_id for m in moves] + [m.target_id for m in moves]
    assert len(set(used)) == 4


def test_llumnix_like_moves_only_when_the_gap_exceeds_the_request() -> None:
    # The variance of current loads falls iff x_s - x_t > N(r); the best move closes the gap most.
    p = policy(mode="current_only", min_reduction_frac=0.0)
    (move,) = p.select(snapshot({"d0": [("big", 5500, 1.0), ("small", 2000, 1.0)], "d1": [("s", 1000, 1.0)]}), 0.0)
    assert (move.rid, move.source_id, move.target_id) == ("small", "d0", "d1")
    assert p.select(snapshot({"d0": [("big", 5500, 1.0)], "d1": [("s", 1000, 1.0)]}), 0.0) == []
    # it looks at nothing but the current loads: a request about to finish moves like any other
    assert p.name == "llumnix-like" and p.preferred_length_predictor is None


def test_registry_builds_the_three_modes() -> None:
    for name, mode, predictor in (("ares", "predicted", "ares-noise"), ("ares-oracle", "oracle", "oracle"),
                                  ("llumnix-like", "current_only", None)):
        built = make_migration_policy(name, MODEL)
        assert isinstance(built, AresMigration) and built.name == name and built.needs_requests
        assert built.params.mode == mode and built.preferred_length_predictor == predictor
        assert name in built.note
    with pytest.raises(Exception, match="theta"):
        AresParams(theta=-1.0)


def test_without_a_model_the_policy_reads_each_instances_profile() -> None:
    # The live migrator passes neither model nor mechanism: the profile named in the registration is used.
    p = make_migration_policy("ares")
    assert p.select(skewed(), 0.0)
