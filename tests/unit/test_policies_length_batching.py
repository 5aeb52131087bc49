"""DOPD length-aware prefill batching: longs alone, shorts held until L_cap or tau_max, greedy knapsack."""

from __future__ import annotations

import math

import pytest

from shared.latency import LatencyModel, load_profile
from shared.policies import LengthBatching, PrefillPolicy, make_prefill_policy
from tests.unit.prefill_items import Prompt

MODEL = LatencyModel(load_profile())
INF = math.inf
BIG = 1 << 30
_check: PrefillPolicy = LengthBatching(MODEL)


def policy(isl: float = 2000.0) -> LengthBatching:
    p = make_prefill_policy("dopd-length", MODEL)
    assert isinstance(p, LengthBatching) and not p.event_driven
    p.set_forecast_isl(isl)  # L_th = L_cap = 2000 tokens
    return p


def parts(p: LengthBatching, queue: list[Prompt], now_s: float, budget: int = BIG) -> list[tuple[str, int]]:
    return [(item.rid, n) for item, n in p.plan(queue, budget, now_s).parts]


def test_a_long_prompt_runs_alone_at_once_and_is_continued() -> None:
    p = policy()
    long, short = Prompt("long", 0.0, 5000), Prompt("short", 0.0, 500)
    assert parts(p, [long, short], 0.0, budget=4096) == [("long", 4096)]
    long.prefilled = 4096  # the chunk ran: the rest of it goes next, before anything else
    assert parts(p, [long, short], 0.01, budget=4096) == [("long", 904)]


def test_shorts_wait_for_the_timeout() -> None:
    p = policy()
    s = Prompt("s", 0.0, 500)
    plan = p.plan([s], BIG, 0.0)
    assert plan.parts == [] and plan.retry_at_s == pytest.approx(0.2)  # no target: tau_cap
    assert p.plan([s], BIG, 0.1).retry_at_s == pytest.approx(0.2)
    assert parts(p, [s], 0.2) == [("s", 500)]


def test_the_timeout_shrinks_with_the_ttft_budget_left() -> None:
    p = policy()
    service = MODEL.prefill_time_s(2000)  # E[S]: one L_cap-token pass
    # Arrived at 0, first seen here at 0.1; SLO 0.3 s: tau = 0.5 x (0.3 - 0.1 - E[S]).
    tight = Prompt("t", 0.0, 500, 0.3)
    assert p.plan([tight], BIG, 0.1).retry_at_s == pytest.approx(0.1 + 0.5 * (0.3 - 0.1 - service))
    # A loose SLO is capped at 200 ms; a hopeless one is not held at all.
    p2 = policy()
    assert p2.plan([Prompt("l", 0.0, 500, 10.0)], BIG, 0.1).retry_at_s == pytest.approx(0.3)
    assert parts(policy(), [Prompt("h", 0.0, 500, 0.05)], 0.1) == [("h", 500)]


def test_shorts_reaching_the_cap_are_packed_shortest_first() -> None:
    p = policy()
    queue = [Prompt("a", 0.0, 800), Prompt("b", 0.0, 700), Prompt("c", 0.0, 600)]
    # 2100 >= L_cap: released at once; 600 + 700 fit in 2000, 800 more would not.
    assert parts(p, queue, 0.0) == [("c", 600), ("b", 700)]
    chunked = policy()
    assert parts(chunked, queue, 0.0, budget=1000) == [("c", 600), ("b", 400)]  # the pass respects the budget
    queue[2].prefilled, queue[1].prefilled = 600, 400
    assert parts(chunked, queue, 0.01, budget=1000) == [("b", 300)]  # the released batch continues, not "a"


def test_an_expired_short_goes_first_so_it_cannot_starve() -> None:
    p = policy()
    old = Prompt("old", 0.0, 1500)
    assert p.plan([old], BIG, 0.0).parts == []
    queue = [old, Prompt("x", 0.25, 300), Prompt("y", 0.25, 400)]
    # "old" waited past tau_max: packed first, then the shortest that still fit (1500 + 300 <= 2000).
    assert parts(p, queue, 0.25) == [("old", 1500), ("x", 300)]


def test_a_due_short_batch_older_than_the_next_long_goes_first() -> None:
    p = policy()
    s = Prompt("s", 0.0, 500)
    l1 = Prompt("l1", 0.1, 5000)
    assert parts(p, [s, l1], 0.1) == [("l1", 5000)]  # the short is not due yet: the long does not wait
    l2 = Prompt("l2", 0.3, 5000)
    assert parts(p, [s, l2], 0.35) == [("s", 500)]  # the short (seen at 0.1) is due and older than l2


def test_partly_prefilled_prompts_continue_first() -> None:
    p = policy()
    queue = [Prompt("long", 0.0, 9000), Prompt("p", 0.1, 3000, prefilled=1000), Prompt("a", 0.2, 900),
             Prompt("b", 0.2, 1200)]
    assert parts(p, queue, 0.3) == [("p", 2000)]


def test_thresholds_follow_the_inputs_seen_until_a_forecast_arrives() -> None:
    p = LengthBatching(MODEL)
    p.plan([Prompt("a", 0.0, 1000)], BIG, 0.0)
    assert p.isl_hat == pytest.approx(1000)
    p.plan([Prompt("a", 0.0, 1000), Prompt("b", 0.0, 3000)], BIG, 0.0)  # "a" is not counted twice
    assert p.isl_hat == pytest.approx(0.95 * 1000 + 0.05 * 3000)
    assert p.long_threshold == pytest.approx(1100) and p.cap_tokens == 1100
    p.set_forecast_isl(4000)
    assert p.long_threshold == pytest.approx(4000)
    p.set_forecast_isl(None)
    assert p.isl_hat == pytest.approx(1100)
