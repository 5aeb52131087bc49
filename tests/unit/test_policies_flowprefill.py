"""FlowPrefill: S-EDF ranking (Eq. 3), SLO-aware batching (Alg. 1), preemption on arrivals, D-EDF ablation."""

from __future__ import annotations

import math
import random

import pytest

from shared.engine.model import EngineModel
from shared.latency import LatencyModel, load_profile
from shared.policies import (
    DEdf,
    FlowPrefill,
    FlowPrefillParams,
    PrefillPolicy,
    Sedf,
    make_prefill_policy,
    preempts,
)
from shared.policies.flowprefill import CAUTIOUS_LATE_COST, fewest_late, rank, sedf_key, ttft_hat
from tests.unit.prefill_items import Prompt

MODEL = LatencyModel(load_profile())
INF = math.inf
BIG = 1 << 30  # an engine that does not chunk
_checks: tuple[PrefillPolicy, PrefillPolicy, PrefillPolicy] = (FlowPrefill(MODEL), Sedf(MODEL), DEdf())


def rids(policy: PrefillPolicy, queue: list[Prompt], now_s: float, budget: int = BIG) -> list[str]:
    return [item.rid for item, _ in policy.plan(queue, budget, now_s).parts]


def test_sedf_puts_feasible_prompts_first_by_deadline_then_infeasible_latest_deadline_first() -> None:
    queue = [
        Prompt("a", 0.0, 100, 1.0),  # feasible, deadline 1.0
        Prompt("b", 0.0, 100, 0.5),  # feasible, deadline 0.5
        Prompt("c", 0.0, 30_000, 0.2),  # ~1.5 s of work: infeasible, deadline 0.2
        Prompt("d", 0.0, 30_000, 1.2),  # infeasible, deadline 1.2
        Prompt("e", 0.0, 100),  # no target
    ]
    assert ttft_hat(MODEL, queue[3]) > 1.2
    assert rids(Sedf(MODEL), queue, 0.0) == ["b", "a", "d", "c", "e"]
    # EDF proper would keep the hopeless "c" first.
    assert rids(make_prefill_policy("edf", MODEL), queue, 0.0)[0] == "c"


def test_ttft_hat_counts_only_what_is_left() -> None:
    # 30K tokens cannot make 1.2 s from scratch, but with 25K already done the last 5K can.
    assert rids(Sedf(MODEL), [Prompt("x", 0.0, 30_000, 1.2, prefilled=25_000), Prompt("y", 0.0, 100, 5.0)], 0.0) == [
        "x", "y"]
    assert rids(Sedf(MODEL), [Prompt("x", 0.0, 30_000, 1.2), Prompt("y", 0.0, 100, 5.0)], 0.0) == ["y", "x"]


def test_dedf_demotes_only_prompts_past_their_deadline() -> None:
    queue = [Prompt("x", 0.0, 30_000, 1.0), Prompt("y", 0.0, 1000, 2.0)]
    # At t=0 "x" cannot finish by 1.0 (S-EDF demotes it) but is not late yet (D-EDF keeps EDF order).
    assert rids(Sedf(MODEL), queue, 0.0) == ["y", "x"]
    assert rids(DEdf(), queue, 0.0) == ["x", "y"]
    assert rids(DEdf(), queue, 1.5) == ["y", "x"]  # past its deadline: now demoted too
    assert rids(FlowPrefill(MODEL, FlowPrefillParams(priority="d-edf", batch_tokens=0)), queue, 0.0) == ["x"]


def test_fewest_late_gives_up_the_long_prompt_that_would_make_two_short_ones_late() -> None:
    # Each alone makes its deadline. In deadline order the 10K-token "a" (~0.39 s) ends after "b"'s and
    # "c"'s deadlines: two late. Giving up "a" makes one late.
    queue = [Prompt("a", 0.0, 10_000, 0.40), Prompt("b", 0.0, 1_000, 0.42), Prompt("c", 0.0, 1_000, 0.44),
             Prompt("late", 0.0, 30_000, 0.5), Prompt("free", 0.0, 100)]
    ranked = rank(MODEL, "sedf", queue, 0.0)
    assert [p.rid for p in ranked] == ["a", "b", "c", "late", "free"]
    assert [p.rid for p in fewest_late(MODEL, queue, 0.0, 4096)] == ["b", "c", "a", "late", "free"]
    assert rids(FlowPrefill(MODEL), queue, 0.0) == ["a"]  # "b" would push the batch past G
    assert rids(make_prefill_policy("flowprefill-fewest-late", MODEL), queue, 0.0) == ["b", "c", "free"]


def test_a_cost_factor_gives_up_what_fits_only_at_the_work_alone() -> None:
    # Three 2K-token prompts (~70 ms each alone) due at 0.25 s: all fit at their work alone, not at 2.5x it
    # (~175 ms each), where only one makes it: the first two are given up (equal costs: the earliest goes).
    queue = [Prompt("a", 0.0, 2_000, 0.25), Prompt("b", 0.0, 2_000, 0.26), Prompt("c", 0.0, 2_000, 0.27)]
    assert [p.rid for p in fewest_late(MODEL, queue, 0.0, 4096)] == ["a", "b", "c"]
    assert [p.rid for p in fewest_late(MODEL, queue, 0.0, 4096, CAUTIOUS_LATE_COST)] == ["c", "a", "b"]
    assert rids(make_prefill_policy("flowprefill-fewest-late-cautious", MODEL), queue, 0.0)[0] == "c"
    with pytest.raises(ValueError, match="late_cost"):
        FlowPrefillParams(fewest_late=True, late_cost=0.5)


def test_the_cautious_count_applies_where_decode_shares_the_steps() -> None:
    queue = [Prompt("a", 0.0, 2_000, 0.25), Prompt("b", 0.0, 2_000, 0.26), Prompt("c", 0.0, 2_000, 0.27)]
    engine = EngineModel("prefill", MODEL, prefill_policy="flowprefill-fewest-late-cautious")
    assert rids(engine.prefill_policy, queue, 0.0)[0] == "a"  # a prefill engine's steps are its own
    for role in ("null", "decode"):  # colocated, or a decode engine prefilling short prompts locally
        engine.switch_role(role)
        assert rids(engine.prefill_policy, queue, 0.0)[0] == "c"
    engine.switch_role("prefill")
    assert rids(engine.prefill_policy, queue, 0.0)[0] == "a"


def test_fewest_late_spreads_the_walk_over_the_engines_the_queue_feeds() -> None:
    # Three 10K-token prompts due at 1.8x one's time alone: one engine makes one of them (the second would end at
    # 2x), three engines make all three (each starts by the time the earlier ones' work is spread over three).
    alone = fewest_late(MODEL, [Prompt("x", 0.0, 10_000, INF)], 0.0, 4096)
    assert [p.rid for p in alone] == ["x"]
    deadline = 1.8 * ttft_hat(MODEL, Prompt("x", 0.0, 10_000))
    queue = [Prompt(r, 0.0, 10_000, deadline) for r in "abc"]
    assert [p.rid for p in fewest_late(MODEL, queue, 0.0, 4096, servers=3)] == ["a", "b", "c"]
    one = [p.rid for p in fewest_late(MODEL, queue, 0.0, 4096, servers=1)]
    assert one[0] == "c" and sorted(one) == ["a", "b", "c"]  # two given up: the walk kept the last it met
    assert one == [p.rid for p in fewest_late(MODEL, queue, 0.0, 4096)]  # one engine: the default
    # The long prompt that one engine gives up for two short ones is kept when two engines serve the queue.
    mixed = [Prompt("a", 0.0, 10_000, 0.40), Prompt("b", 0.0, 1_000, 0.42), Prompt("c", 0.0, 1_000, 0.44)]
    assert [p.rid for p in fewest_late(MODEL, mixed, 0.0, 4096, servers=2)] == ["a", "b", "c"]
    policy = FlowPrefill(MODEL, FlowPrefillParams(fewest_late=True))
    assert [item.rid for item, _ in policy.plan_for(mixed, BIG, 0.0, 2).parts] == ["a"]
    assert rids(policy, mixed, 0.0) == ["b", "c"]


def _fewest_late_as_specified(queue: list[Prompt], now_s: float, batch_tokens: int) -> list[Prompt]:
    """Moore and Hodgson's rule over S-EDF written plainly from sedf_key and ttft_hat: what the optimised
    fewest_late must return to the last element."""
    ranked = sorted(queue, key=lambda r: sedf_key(MODEL, r, now_s))
    feasible = [r for r in ranked if sedf_key(MODEL, r, now_s)[0] == 0]
    overhead = MODEL.profile.prefill_overhead_s
    finish, taken, given_up = now_s, [], set()
    for i, r in enumerate(feasible):
        n = r.input_tokens - r.prefilled
        cost = MODEL.prefill_work_s(n, r.prefilled) + overhead * min(1.0, n / batch_tokens)
        finish += cost
        taken.append((cost, i))
        if finish > r.arrival_s + r.slo_ttft_s:
            longest = max(taken, key=lambda t: (t[0], -t[1]))  # the longest; of equals, the earliest
            taken.remove(longest)
            finish -= longest[0]
            given_up.add(longest[1])
    kept = [r for i, r in enumerate(feasible) if i not in given_up]
    return kept + [feasible[i] for i in sorted(given_up)] + ranked[len(feasible):]


@pytest.mark.parametrize("seed", range(20))
def test_fewest_late_is_moore_hodgson_over_sedf_on_random_queues(seed: int) -> None:
    rng = random.Random(seed)
    queue = [Prompt(f"r{i}", rng.uniform(0.0, 2.0), rng.choice([64, 500, 2000, 8000, 20_000]),
                    rng.choice([0.5, 1.0, 2.0, 3.0, INF]), prefilled=0) for i in range(rng.randint(1, 60))]
    for r in queue[::4]:
        r.prefilled = r.input_tokens // 2
    for now in (0.5, 2.0, 3.5):
        assert [p.rid for p in fewest_late(MODEL, queue, now, 4096)] == [
            p.rid for p in _fewest_late_as_specified(queue, now, 4096)]


def test_fewest_late_keeps_the_deadline_order_when_everything_fits() -> None:
    queue = [Prompt("a", 0.0, 10_000, 1.0), Prompt("b", 0.0, 1_000, 1.1), Prompt("c", 0.0, 1_000, 1.2)]
    assert fewest_late(MODEL, queue[::-1], 0.0, 4096) == rank(MODEL, "sedf", queue, 0.0) == queue
    # Later in time the same queue no longer fits, and only the long prompt is given up.
    assert [p.rid for p in fewest_late(MODEL, queue, 0.7, 4096)] == ["b", "c", "a"]


def test_fewest_late_without_a_batch_budget_charges_each_prompt_a_whole_launch() -> None:
    queue = [Prompt("a", 0.0, 10_000, 0.40), Prompt("b", 0.0, 1_000, 0.42), Prompt("c", 0.0, 1_000, 0.44)]
    plan = FlowPrefill(MODEL, FlowPrefillParams(batch_tokens=0, fewest_late=True)).plan(queue, BIG, 0.0)
    assert [item.rid for item, _ in plan.parts] == ["b"]  # no batch budget: the head runs alone


def test_fewest_late_needs_sedf() -> None:
    with pytest.raises(ValueError, match="S-EDF"):
        FlowPrefillParams(priority="edf", fewest_late=True)


def test_batching_stays_under_g_and_meets_the_head_deadline() -> None:
    policy = FlowPrefill(MODEL)
    queue = [
        Prompt("h", 0.0, 2000, 1.0),
        Prompt("s1", 0.0, 1000, 2.0),
        Prompt("big", 0.0, 3000, 3.0),  # 2000 + 1000 + 3000 >= G = 4096: skipped
        Prompt("s2", 0.0, 1000, 4.0),  # first fit after the skip: 4000 < 4096
    ]
    assert rids(policy, queue, 0.0) == ["h", "s1", "s2"]
    # The pass respects the engine's budget: H first, then members, the last one partial.
    assert [(i.rid, n) for i, n in policy.plan(queue, 2500, 0.0).parts] == [("h", 2000), ("s1", 500)]
    # A tight head deadline: adding 1000 tokens would overrun 0.1 s, a 100-token prompt does not.
    tight = [Prompt("h", 0.0, 2000, 0.1), Prompt("s1", 0.0, 1000, 2.0), Prompt("tiny", 0.0, 100, 3.0)]
    assert MODEL.prefill_batch_time_s([(2000, 0), (1000, 0)]) > 0.1 > MODEL.prefill_batch_time_s([(2000, 0), (100, 0)])
    assert rids(policy, tight, 0.0) == ["h", "tiny"]
    # The head alone may exceed G; nothing joins it then.
    assert [(i.rid, n) for i, n in policy.plan([Prompt("long", 0.0, 10_000, 1.5), *queue[1:]], BIG, 0.0).parts] == [
        ("long", 10_000)]
    # No batching budget: the head runs alone.
    assert rids(FlowPrefill(MODEL, FlowPrefillParams(batch_tokens=0)), queue, 0.0) == ["h"]


def test_fig8_a_high_priority_arrival_preempts_the_running_prompt() -> None:
    policy = make_prefill_policy("flowprefill", MODEL)
    assert policy.event_driven and not Sedf(MODEL).event_driven and not DEdf().event_driven
    a = Prompt("A", 0.0, 6000, 10.0)
    first = policy.plan([a], BIG, 0.0)
    assert [(i.rid, n) for i, n in first.parts] == [("A", 6000)]
    running = first.parts
    # B (deadline 0.55, far earlier than A's 10 s) arrives while A is running, part of A computed.
    a.prefilled = 1500
    b = Prompt("B", 0.05, 500, 0.5)
    second = policy.plan([a, b], BIG, 0.05)
    assert second.parts[0][0] is b and preempts(second, running)
    assert not preempts(policy.plan([a], BIG, 0.05), running)  # no new head: keep running
    # B done: A resumes from where it stopped.
    assert [(i.rid, n) for i, n in policy.plan([a], BIG, 0.2).parts] == [("A", 4500)]
