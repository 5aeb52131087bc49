"""The engine model (shared/engine/model.py) on virtual time: no event loop, no sleeps. A test drives it the way
both adapters do (plan at a step boundary, the clock moves by the step's time, apply) and checks SGLang's
scheduling rules: KV admission in plan order, the decode KV reservation and its growth, retraction in SGLang's
order and resumption, colocated retraction by recompute, the prefix cache, operator-level cuts, removal from
any queue."""

from __future__ import annotations

from typing import Any

import pytest

from shared.engine import token_blocks
from shared.engine.model import EngineModel, EngineRequest, Phase, Step, retraction_order
from shared.latency import LatencyModel, load_profile

LATENCY = LatencyModel(load_profile())


def model(role: str = "null", **kw: Any) -> EngineModel:
    kw.setdefault("decode_kv", "grow")
    kw.setdefault("colocated_kv", "grow")
    return EngineModel(role, LATENCY, **kw)  # type: ignore[arg-type]


def request(rid: str, prompt: int, output: int, *, arrival_s: float = 0.0, blocks: tuple[int, ...] = ()) -> EngineRequest:
    return EngineRequest(rid=rid, arrival_s=arrival_s, input_tokens=prompt, output_tokens=output, blocks=blocks)


class Clock:
    """Virtual time: each step takes its modelled seconds, nothing else passes."""

    def __init__(self) -> None:
        self.now = 0.0
        self.steps: list[Step] = []
        self.finished: list[EngineRequest] = []

    def step(self, eng: EngineModel) -> Step | None:
        step = eng.plan(self.now)
        self.finished += step.finished
        for req in step.admitted:  # decode: the adapter's KV transfer, done at once here
            eng.transfer_done(req)
        if step.idle:
            return None if not step.admitted else self.step(eng)
        self.now += step.time_s
        self.steps.append(step)
        applied = eng.apply(step, self.now)
        self.finished += applied.finished
        if eng.role == "prefill":
            for req in applied.prompts_done:  # the adapter's transfer: done at once here
                eng.release_prompt(req, self.now)
        return step

    def run(self, eng: EngineModel, max_steps: int = 100_000) -> None:
        for _ in range(max_steps):
            if self.step(eng) is None:
                return
        raise AssertionError("the engine never went idle")


def test_colocated_requests_run_to_their_length_and_free_every_token() -> None:
    eng, clock = model(), Clock()
    reqs = [request(f"r{i}", 1000 + 100 * i, 20 + i) for i in range(5)]
    eng.add_prompts(reqs)
    clock.run(eng)
    assert sorted(r.rid for r in clock.finished) == [r.rid for r in reqs]
    assert all(r.generated == r.output_tokens and r.phase is Phase.FINISHED for r in reqs)
    assert eng.used_kv == 0 and eng.running_context == 0 and eng.empty
    # The first token comes at the boundary after the prompt's last prefill step, on virtual time.
    assert all(r.first_token_s is not None and r.first_token_s >= LATENCY.prefill_time_s(1000) for r in reqs)


def test_prefill_admits_in_plan_order_and_holds_the_prompt_until_the_transfer() -> None:
    eng = model("prefill", chunk_tokens=8192)
    a, b, c = request("a", 3000, 1), request("b", 4000, 1), request("c", 5000, 1)
    eng.add_prompts([a, b, c])
    step = eng.plan(0.0)
    assert [(r.rid, n) for r, n in step.prefill] == [("a", 3000), ("b", 4000), ("c", 1192)]
    assert eng.used_kv == 12000 and [r.prompt_kv for r in (a, b, c)] == [3000, 4000, 5000]
    applied = eng.apply(step, step.time_s)
    assert [r.rid for r in applied.prompts_done] == ["a", "b"] and a.phase is Phase.INFLIGHT
    eng.release_prompt(a, step.time_s)  # the decode side has a's KV
    assert eng.used_kv == 9000 and a.prompt_kv == 0


def test_a_prompt_that_does_not_fit_waits_and_so_do_the_ones_planned_after_it() -> None:
    eng = model("prefill", kv_capacity=6000, chunk_tokens=8192)
    big, small = request("big", 5000, 1), request("small", 500, 1)
    eng.add_prompts([request("first", 2000, 1), big, small])
    step = eng.plan(0.0)
    assert [r.rid for r, _ in step.prefill] == ["first"]  # big does not fit next to it: small waits behind
    assert big.phase is Phase.WAITING and small.phase is Phase.WAITING


def test_a_colocated_engine_prefills_no_more_prompts_than_it_has_running_slots() -> None:
    # SGLang's get_num_allocatable_reqs: a new prefill batch takes at most max_running_requests less the
    # requests already running; the rest wait unprefilled, holding no KV, until one finishes.
    eng = model(max_running=3)
    reqs = [request(f"r{i}", 100, 50 + i) for i in range(7)]
    eng.add_prompts(reqs)
    step = eng.plan(0.0)
    assert [r.rid for r, _ in step.prefill] == ["r0", "r1", "r2"]
    assert all(r.phase is Phase.WAITING and r.kv_held == 0 for r in reqs[3:])
    eng, clock = model(max_running=3), Clock()
    reqs = [request(f"r{i}", 100, 50 + i) for i in range(7)]
    eng.add_prompts(reqs)
    most = 0
    while (s := clock.step(eng)) is not None:
        most = max(most, len(eng.running) + len(eng.ready) + len(eng.prefilling))
        assert s.decode is None or len(s.decode) <= 3
    assert most == 3 and sorted(r.rid for r in clock.finished) == [r.rid for r in reqs]


def test_give_up_late_refuses_only_unstarted_prompts_past_their_target() -> None:
    # One running slot, taken by a long request: the queue behind it waits. At each boundary the prompts that
    # waited past their TTFT target without starting leave (the adapter refuses them); one with time left,
    # one without a target, and one back from a retraction (its output is already out) stay.
    eng = model(max_running=1, give_up_late=True)
    blocker = request("blocker", 100, 400)
    eng.add_prompts([blocker])
    clock = Clock()
    clock.step(eng)  # the blocker's prefill; it now holds the slot
    late = request("late", 100, 4, arrival_s=clock.now)
    late.slo_ttft_s = 0.5
    in_time = request("in-time", 100, 4, arrival_s=clock.now)
    in_time.slo_ttft_s = 60.0
    untimed = request("untimed", 100, 4, arrival_s=clock.now)
    back = request("back", 100, 4, arrival_s=clock.now)
    back.slo_ttft_s, back.recompute = 0.5, True
    eng.add_prompts([late, in_time, untimed, back])
    given_up: list[EngineRequest] = []
    while clock.now < 1.0:
        step = clock.step(eng)
        assert step is not None
        given_up += step.given_up
    assert [r.rid for r in given_up] == ["late"] and late.phase is Phase.FINISHED and late.kv_held == 0
    assert [r.rid for r in eng.waiting] == ["in-time", "untimed", "back"]
    clock.run(eng)
    assert sorted(r.rid for r in clock.finished) == ["back", "blocker", "in-time", "untimed"]
    assert eng.used_kv == 0
    # Off by default (SGLang's engines): the same late prompt waits and is served.
    plain = model(max_running=1)
    plain.add_prompts([request("blocker", 100, 400)])
    clock = Clock()
    clock.step(plain)
    late = request("late", 100, 4, arrival_s=clock.now)
    late.slo_ttft_s = 0.5
    plain.add_prompts([late])
    clock.run(plain)
    assert sorted(r.rid for r in clock.finished) == ["blocker", "late"]


def test_decode_reserves_prompt_plus_sglangs_reserve_and_grows_a_token_a_step() -> None:
    eng = model("decode", reserved_decode_tokens=8)
    req = request("d", 100, 30)
    eng.add_prealloc(req)
    step = eng.plan(0.0)
    assert step.admitted == [req] and req.kv_held == 108 and req.phase is Phase.TRANSFER
    eng.transfer_done(req)
    clock = Clock()
    clock.run(eng)
    assert req.generated == 30 and req.first_token_s == 0.0 and eng.used_kv == 0


def test_decode_retracts_in_sglangs_order_when_growth_does_not_fit_and_resumes_later() -> None:
    # Reservations (prompt + 8) fit all four, their outputs (200 each) do not: growth must retract.
    eng, clock = model("decode", kv_capacity=1000, reserved_decode_tokens=8), Clock()
    reqs = [request(f"k{i}", 100 + i, 200) for i in range(4)]
    for r in reqs:
        eng.add_prealloc(r)
    for r in eng.plan(0.0).admitted:
        eng.transfer_done(r)
    peak = 0
    retracted: list[str] = []
    while (step := clock.step(eng)) is not None or eng.retracted:
        if step is None:
            raise AssertionError("retracted requests never resumed")
        peak = max(peak, eng.used_kv)
        assert eng.used_kv <= eng.kv_capacity
        retracted += [r.rid for r in step.retracted]
    assert retracted and eng.retractions == len(retracted)
    # The first to go: fewest output tokens, then the longest prompt (all joined together: the longest prompt).
    assert retracted[0] == "k3"
    assert all(r.generated == 200 for r in reqs) and eng.used_kv == 0 and peak > 900


def test_retraction_order_is_sglangs() -> None:
    reqs = [request(str(i), n, 100) for i, n in enumerate((100, 900, 500))]
    reqs[0].generated, reqs[1].generated, reqs[2].generated = 5, 5, 50
    assert min(reqs, key=retraction_order) is reqs[1]


def test_colocated_retraction_prefills_the_request_again_with_its_output() -> None:
    eng, clock = model(kv_capacity=1200, reserved_decode_tokens=4), Clock()
    reqs = [request(f"c{i}", 300, 300) for i in range(3)]
    eng.add_prompts(reqs)
    recomputed = set()
    while (step := clock.step(eng)) is not None:
        for r in step.retracted:
            assert r.phase is Phase.WAITING and r.recompute and r.input_tokens == r.prompt_tokens + r.generated
            recomputed.add(r.rid)
        assert eng.used_kv + (eng.cache.tokens if eng.cache else 0) <= eng.kv_capacity
    assert recomputed and all(r.generated == 300 and r.input_tokens == 300 for r in reqs)
    assert eng.used_kv == 0


def test_whole_output_reservations_never_retract() -> None:
    eng, clock = model("decode", decode_kv="whole", kv_capacity=1000), Clock()
    reqs = [request(f"w{i}", 100, 200) for i in range(4)]
    for r in reqs:
        eng.add_prealloc(r)
    assert [r.rid for r in eng.admit_prealloc(0.0)] == ["w0", "w1", "w2"]  # 300 each: the fourth waits
    assert eng.used_kv == 900
    for r in reqs[:3]:
        eng.transfer_done(r)
    clock.run(eng)
    assert eng.retractions == 0 and all(r.generated == 200 for r in reqs) and eng.used_kv == 0


def test_the_prefix_cache_skips_a_cached_prefix_and_locks_it_while_used() -> None:
    eng, clock = model(prefix_cache=True), Clock()
    tokens = list(range(4096))
    first = request("a", 4096, 2, blocks=token_blocks(tokens))
    eng.add_prompts([first])
    clock.run(eng)
    assert eng.cache is not None and eng.cache.tokens == 4096 and eng.cache.locked_tokens == 0
    second = request("b", 4096 + 1000, 2, blocks=token_blocks(tokens + list(range(10**6, 10**6 + 1000))))
    eng.add_prompts([second])
    step = eng.plan(clock.now)
    assert second.cached == 4096 and step.prefill == [(second, 1000)]
    assert eng.cache.locked_tokens == 4096  # locked by b until it lets go of its KV
    clock.run(eng)
    assert eng.cache.locked_tokens == 0 and eng.used_kv == 0 and second.generated == 2


def test_a_role_switch_starts_an_empty_cache_and_decode_keeps_none() -> None:
    eng = model("prefill", prefix_cache=True)
    assert eng.cache is not None
    eng.cache.record((1, 2), 1024, 0.0)
    eng.switch_role("decode")
    assert eng.cache is None and eng.grows
    eng.switch_role("prefill")
    assert eng.cache is not None and eng.cache.tokens == 0


def test_an_operator_cut_keeps_the_elapsed_share_and_asks_for_a_new_plan() -> None:
    eng = model("prefill", chunk_tokens=0, prefill_policy="flowprefill", preemption="operator")
    long = request("long", 60000, 1)
    eng.add_prompts([long])
    step = eng.plan(0.0)
    assert step.prefill == [(long, 60000)]
    urgent = request("urgent", 500, 1, arrival_s=0.1)
    urgent.slo_ttft_s = 0.2
    eng.add_prompts([urgent])
    cut = eng.preemption_point(step, 0.0, 0.1)
    assert cut is not None and 0.1 <= cut < step.time_s
    done = eng.cut(step, cut)
    assert 0 < done == long.prefilled < 60000 and eng.replan
    nxt = eng.plan(cut)
    assert nxt.prefill[0][0] is urgent  # the urgent prompt runs next; the long one resumes after it


@pytest.mark.parametrize("where", ["waiting", "prefilling", "prealloc", "transfer", "ready", "running", "retracted"])
def test_removal_from_any_queue_frees_what_the_request_holds(where: str) -> None:
    role = "null" if where in ("waiting", "prefilling") else "decode"
    eng = model(role, reserved_decode_tokens=8)
    req = request("x", 1000, 50)
    if role == "null":
        eng.add_prompts([req])
        if where == "prefilling":
            eng.plan(0.0)
    else:
        eng.add_prealloc(req)
        if where != "prealloc":
            eng.plan(0.0)
        if where in ("ready", "running", "retracted"):
            eng.transfer_done(req)
        if where in ("running", "retracted"):
            eng.plan(0.0)
        if where == "retracted":
            eng.unrun(req)
            eng.used_kv -= req.kv_held
            req.kv_held = 0
            req.phase = Phase.RETRACTED
            eng.retracted.append(req)
    assert req.phase.value == where
    eng.remove(req, 1.0)
    assert eng.used_kv == 0 and eng.empty and req.kv_held == 0
