"""Kairos: urgency-ordered prefill (Algorithms 1-2, both variants) and slack-guided decode batching (Alg. 3)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import pytest

from shared.latency import LatencyModel, load_profile
from shared.policies import (
    DecodeBatchPolicy,
    KairosLiteralPrefill,
    KairosParams,
    KairosPrefill,
    KairosSlack,
    KairosSlackParams,
    PrefillPolicy,
    make_decode_batch_policy,
    make_prefill_policy,
)
from tests.unit.prefill_items import Prompt

MODEL = LatencyModel(load_profile())
INF = math.inf
_checks: tuple[PrefillPolicy, PrefillPolicy, DecodeBatchPolicy] = (
    KairosPrefill(MODEL), KairosLiteralPrefill(MODEL), KairosSlack(MODEL))  # mypy: they satisfy the Protocols


@dataclass
class Running:
    rid: str
    input_tokens: int
    slo_tpot_s: float = 0.05
    generated: int = 1
    first_token_s: float | None = 0.0


def heads(policy: PrefillPolicy, queue: list[Prompt], budget: int, now_s: float) -> list[tuple[str, int]]:
    return [(item.rid, n) for item, n in policy.plan(queue, budget, now_s).parts]


def paper_example(slo_s: float) -> list[Prompt]:
    """Spec 2.11 #1: a 128K prompt at t=0, an 8K prompt at t=0.5, nothing prefilled yet."""
    return [Prompt("long", 0.0, 131_072, slo_s), Prompt("short", 0.5, 8192, slo_s)]


@pytest.mark.parametrize("slo_s", [8.0, 20.0])
def test_paper_example_literal_keeps_the_long_prompt_when_both_slacks_are_negative(slo_s: float) -> None:
    params = KairosParams(mu_prefill_tps=14_900.0)
    literal, kairos = KairosLiteralPrefill(MODEL, params), KairosPrefill(MODEL, params)
    queue = paper_example(slo_s)
    u_long, u_short = literal.urgencies(queue, 0.5)
    assert u_long.finish_s == pytest.approx(0.5 + 131_072 / 14_900)
    assert u_short.finish_s == pytest.approx(0.5 + (131_072 + 8192) / 14_900)
    if slo_s == 8.0:
        # Both miss under FCFS: the literal descending (slack/SLO)/len puts the long one first (erratum 8).
        assert u_long.slack_s < 0 and u_short.slack_s < 0 and u_long.urgency > u_short.urgency
        assert heads(literal, queue, 8192, 0.5) == [("long", 8192)]
    else:
        # Both have slack: the literal rule favours the short prompt, as the paper says.
        assert u_long.slack_s > 0 and u_short.slack_s > 0 and u_short.urgency > u_long.urgency
        assert heads(literal, queue, 8192, 0.5) == [("short", 8192)]
    # The default variant follows the paper's prose in both regimes: the 8K prompt goes first.
    assert heads(kairos, queue, 8192, 0.5) == [("short", 8192)]
    assert heads(kairos, queue, 10_000, 0.5) == [("short", 8192), ("long", 1808)]


def test_chunk_is_filled_in_urgency_order_with_a_partial_last_part() -> None:
    policy = KairosPrefill(MODEL)
    # Plenty of slack for all: ascending (slack/SLO) * input_len, so the shortest, then 3000, then 6000
    # tokens of which 2000 are already done (4000 left): the chunk takes what fits of it.
    queue = [Prompt("a", 0.0, 6000, 10.0, prefilled=2000), Prompt("b", 1.0, 1000, 10.0), Prompt("c", 2.0, 3000, 10.0)]
    assert heads(policy, queue, 8192, 2.0) == [("b", 1000), ("c", 3000), ("a", 4000)]
    assert heads(policy, queue, 5000, 2.0) == [("b", 1000), ("c", 3000), ("a", 1000)]


def test_infeasible_prompts_go_after_feasible_ones_shortest_first() -> None:
    policy = KairosPrefill(MODEL, KairosParams(mu_prefill_tps=10_000.0))
    # "big" (5 s of work) cannot make 1 s, nor "mid" behind it; "ok" has 30 s. "mid" is shorter than "big".
    queue = [Prompt("big", 0.0, 50_000, 1.0), Prompt("mid", 0.0, 20_000, 1.0), Prompt("ok", 0.0, 1000, 30.0)]
    assert [rid for rid, _ in heads(policy, queue, 1 << 30, 0.0)] == ["ok", "mid", "big"]


def test_prompts_without_a_target_rank_last_in_arrival_order() -> None:
    for policy in (KairosPrefill(MODEL), KairosLiteralPrefill(MODEL)):
        queue = [Prompt("x", 0.0, 500), Prompt("y", 0.1, 100), Prompt("t", 0.2, 4000, 2.0)]
        scores = policy.urgencies(queue, 0.3)
        assert not any(math.isnan(s.urgency) or math.isnan(s.slack_s) for s in scores)
        assert [rid for rid, _ in heads(policy, queue, 1 << 30, 0.3)] == ["t", "x", "y"], policy.name


def test_mu_prefill_is_seeded_from_the_profile_and_follows_observations() -> None:
    policy = KairosPrefill(MODEL)
    chunk = MODEL.profile.chunked_prefill_size
    mu0 = chunk / MODEL.prefill_time_s(chunk)
    assert policy.mu_prefill == pytest.approx(mu0)
    policy.observe(10_000, 0.5)
    assert policy.mu_prefill == pytest.approx(0.9 * mu0 + 0.1 * 20_000)
    policy.observe(0, 0.5)
    policy.observe(100, 0.0)  # nothing computed / free compute: no change
    assert policy.mu_prefill == pytest.approx(0.9 * mu0 + 0.1 * 20_000)
    # A slower engine pushes finish times out.
    before = policy.urgencies([Prompt("a", 0.0, 8192, 8.0)], 0.0)[0].finish_s
    for _ in range(20):
        policy.observe(1000, 1.0)
    assert policy.urgencies([Prompt("a", 0.0, 8192, 8.0)], 0.0)[0].finish_s > before


def test_registry_builds_both_variants_and_kairos_slack() -> None:
    assert isinstance(make_prefill_policy("kairos", MODEL), KairosPrefill)
    literal = make_prefill_policy("kairos-literal", MODEL)
    assert isinstance(literal, KairosLiteralPrefill) and literal.name == "kairos-literal" and not literal.event_driven
    slack = make_decode_batch_policy("kairos-slack", MODEL)
    assert isinstance(slack, KairosSlack) and not slack.selects_all

#: Algorithm 3 as written (the registry's kairos-slack-paper); the default differs in the two ways below.
PAPER = KairosSlackParams(slack_reserve="solo", yield_to_kv_waiters=False)


def mixed_batch(tpot_s: float) -> list[Running]:
    return [Running(f"l{i}", 64_000, tpot_s) for i in range(4)] + [Running(f"s{i}", 1000, tpot_s) for i in range(4)]


def test_loose_tpot_decodes_only_the_short_requests() -> None:
    policy = KairosSlack(MODEL, PAPER)
    batch = mixed_batch(0.05)
    # Slack 50 ms minus a solo 64K step (~11 ms) leaves ~39 ms: the four short requests fit (one ~8 ms step),
    # and adding a 64K request would cost a (8 x 64K) worst-case step for 5 tokens: tokens/s would drop.
    chosen = policy.select(batch, 256, 0.0)
    assert [r.rid for r in chosen] == ["s0", "s1", "s2", "s3"]
    assert policy.select(batch, 2, 0.0) == batch[4:6]  # never more than max_batch


def test_no_slack_decodes_everything() -> None:
    policy = KairosSlack(MODEL, PAPER)
    tight = mixed_batch(0.01)  # 10 ms SLO < a solo 64K step: negative slack
    assert policy.select(tight, 256, 0.0) == tight
    late = mixed_batch(0.05)
    late[0].first_token_s = -1.0  # one request 1 s behind its deadline: nobody may be delayed
    assert policy.select(late, 256, 0.0) == late
    assert policy.select(late, 3, 0.0) == late[:3]
    assert policy.select([], 256, 0.0) == []


def test_requests_without_a_tpot_target_do_not_constrain_the_slack() -> None:
    policy = KairosSlack(MODEL, PAPER)
    free = [Running("a", 64_000, INF), Running("b", 1000, INF, first_token_s=None)]
    assert policy.select(free, 256, 0.0) == free  # no deadline anywhere: continuous batching
    # A best-effort request long overdue by any target does not block the others' slack batching.
    mixed = [*mixed_batch(0.05), Running("be", 64_000, INF, first_token_s=-100.0)]
    assert [r.rid for r in policy.select(mixed, 256, 0.0)] == ["s0", "s1", "s2", "s3"]


def test_slack_counts_the_first_token_as_generated() -> None:
    policy = KairosSlack(MODEL, PAPER)
    # generated = 3 (the prefill's token and two decoded): the 4th token is due at first_token + 3 x SLO.
    item = Running("r", 1000, 0.05, generated=3, first_token_s=10.0)
    assert policy.slack(item, 10.04, reserve_s=0.0) == pytest.approx(3 * 0.05 - 0.04)
    assert policy.slack(item, 10.04) == pytest.approx(3 * 0.05 - 0.04 - policy.lut(1, 1003))


def test_lut_rounds_up_to_the_worst_case_and_learns() -> None:
    policy = KairosSlack(MODEL, PAPER)
    # Round-up buckets, seeded at the upper corner with b x L tokens (every member as long as the longest).
    assert policy.lut(3, 1000) == pytest.approx(MODEL.decode_step_time_s(4, 4 * 1024))
    assert policy.lut(4, 1024) == policy.lut(3, 1000)
    assert policy.lut(5, 1000) > policy.lut(4, 1000)
    seed = policy.lut(8, 1000)
    policy.observe(8, 1000, 8000, 1.0)  # a very slow step moves the entry by 1/101 of the gap
    assert policy.lut(8, 1000) == pytest.approx(seed + (1.0 - seed) / 101)
    policy.observe(7, 600, 4000, 0.0)
    assert policy.lut(8, 1000) == pytest.approx(seed + (1.0 - seed) / 101 - (seed + (1.0 - seed) / 101) / 102)
    assert policy.lut(4, 1000) == pytest.approx(MODEL.decode_step_time_s(4, 4 * 1024))  # other entries untouched
    total = KairosSlack(MODEL, KairosSlackParams(lut_mode="total_tokens"))
    assert total.lut(3, 3000) == pytest.approx(MODEL.decode_step_time_s(4, 4096))


def test_the_default_reserves_the_decode_all_step_and_yields_to_kv_waiters() -> None:
    batch = mixed_batch(0.05)
    paper, default = KairosSlack(MODEL, PAPER), KairosSlack(MODEL)
    assert len(paper.select(batch, 256, 0.0)) < len(batch)
    # Reserving the decode-all step leaves less slack than the solo step: never more delayed than the paper.
    assert len(default.select(batch, 256, 0.0)) >= len(paper.select(batch, 256, 0.0))
    assert default.slack(batch[0], 0.0, reserve_s=None) >= default.slack(
        batch[0], 0.0, reserve_s=default.lut(len(batch), max(default.seq_len(r) for r in batch)))
    # Requests wait for KV: nobody is held back (holding a request holds its KV).
    assert default.select(batch, 256, 0.0, kv_waiting=3) == batch
    assert len(paper.select(batch, 256, 0.0, kv_waiting=3)) < len(batch)
