"""engine_sim's engine policies (shared/policies) in-process: how the prefill policy plans each pass (arrival
order, KV admission in plan order, no chunking, event-driven policies, retry times, observe), the decode
policy's observe, operator-level preemption vs chunk boundaries, and the ``poise_slo`` request field."""

from __future__ import annotations

import asyncio
import functools
import math
from collections.abc import Sequence
from typing import Any, TypeVar

import pytest

from services.engine_sim import batching, clock
from services.engine_sim import protocol as P
from services.engine_sim.config import EngineSimSettings
from services.engine_sim.engine import SimEngine
from services.engine_sim.reports import load
from services.engine_sim.requests import Phase, SimRequest
from shared.latency import LatencyModel
from shared.policies import DECODE_BATCH_POLICIES, PREFILL_POLICIES
from shared.policies.prefill_order import MAX_PREFILL_TOKENS, PrefillItem, PrefillPlan, fill
from shared.protocol.request_slo import RequestSlo
from tests.unit.test_engine_sim_core import REAL_TIME, VIRTUAL_TIME, make_engine, running, until

pytestmark = VIRTUAL_TIME  # PD pairs on the real clock (REAL_TIME)

T = TypeVar("T", bound=PrefillItem)




async def finish(engine: SimEngine, req: SimRequest, timeout_s: float = 10.0) -> SimRequest:
    await asyncio.wait_for(engine.wait_for(req), timeout_s)
    assert req.finished
    return req


def queue(engine: SimEngine, *prompts: int, slo_ttft_s: Sequence[float] = ()) -> list[SimRequest]:
    """Submit prompts to a stopped colocated engine and move them into its waiting queue."""
    reqs = []
    for i, n in enumerate(prompts):
        req = engine.submit(prompt_tokens=n, max_new_tokens=4, ignore_eos=True, rid=f"q{i}")
        if i < len(slo_ttft_s):
            req.slo_ttft_s = slo_ttft_s[i]
        reqs.append(req)
    batching.take_intake(engine)
    return reqs


def parts(step: batching.Step | None) -> list[tuple[str, int]]:
    assert step is not None
    return [(r.rid, n) for r, n in step.prefill]


# -- test-local policies -----------------------------------------------------------------------------------
class Recording:
    """FCFS chunks that records what the engine asks and tells it."""

    name = "test-recording"
    event_driven = False

    def __init__(self) -> None:
        self.plans: list[list[str]] = []
        self.observed: list[tuple[int, float]] = []

    def plan(self, queue: Sequence[T], budget: int, now_s: float) -> PrefillPlan[T]:
        self.plans.append([r.rid for r in queue])
        return PrefillPlan(fill(queue, budget))

    def observe(self, tokens: int, seconds: float) -> None:
        self.observed.append((tokens, seconds))


class EventDriven(Recording):
    """Shortest remaining prompt first, asked only on arrivals and completions (like FlowPrefill)."""

    name = "test-event"
    event_driven = True

    def plan(self, queue: Sequence[T], budget: int, now_s: float) -> PrefillPlan[T]:
        self.plans.append([r.rid for r in queue])
        return PrefillPlan(fill(sorted(queue, key=lambda r: r.input_tokens - r.prefilled), budget))


class WaitsFirst(Recording):
    """Holds the queue back until ``hold_s`` after its first plan (a batching timeout), then FCFS."""

    name = "test-waits"
    hold_s = 0.2

    def __init__(self) -> None:
        super().__init__()
        self.release_at: float | None = None

    def plan(self, queue: Sequence[T], budget: int, now_s: float) -> PrefillPlan[T]:
        self.plans.append([r.rid for r in queue])
        if self.release_at is None:
            self.release_at = now_s + self.hold_s
        if now_s < self.release_at:
            return PrefillPlan([], retry_at_s=self.release_at)
        return PrefillPlan(fill(queue, budget))


class RecordingDecode:
    name = "test-decode"
    selects_all = False

    def __init__(self) -> None:
        self.observed: list[tuple[int, int, int, float]] = []

    def select(self, running: Sequence[Any], max_batch: int, now_s: float, kv_waiting: int = 0) -> Sequence[Any]:
        for r in running:  # the DecodeItem fields the engine's requests provide
            assert r.input_tokens == r.prompt_tokens and r.generated >= 1  # joined: its first token is out
            assert r.first_token_s is not None and r.slo_tpot_s > 0
        return running[:max_batch]

    def observe(self, batch_size: int, max_context: int, total_context: int, seconds: float) -> None:
        self.observed.append((batch_size, max_context, total_context, seconds))


@pytest.fixture
def local_policies(monkeypatch: pytest.MonkeyPatch) -> None:
    for cls in (Recording, EventDriven, WaitsFirst):
        monkeypatch.setitem(PREFILL_POLICIES, cls.name, functools.partial(lambda c, model: c(), cls))
    monkeypatch.setitem(DECODE_BATCH_POLICIES, RecordingDecode.name, lambda model: RecordingDecode())


# -- settings -------------------------------------------------------------------------------------------------
def test_settings_names_and_validation() -> None:
    s = EngineSimSettings()
    assert (s.prefill_policy, s.decode_policy, s.preemption) == ("fcfs", "continuous", "chunk")
    assert EngineSimSettings(chunked_prefill_size=-1, preemption="operator").preemption == "operator"
    with pytest.raises(ValueError, match="chunked_prefill_size"):
        EngineSimSettings(chunked_prefill_size=0)
    with pytest.raises(ValueError):
        EngineSimSettings(chunked_prefill_size=-2)
    with pytest.raises(ValueError):
        EngineSimSettings(preemption="layer")  # type: ignore[arg-type,call-arg]
    with pytest.raises(ValueError):  # the old names are gone (extra fields are forbidden)
        EngineSimSettings(prefill_order="edf")  # type: ignore[call-arg]


def test_server_info_reports_the_policies_and_preemption() -> None:
    info = make_engine(mode="prefill", prefill_policy="edf", preemption="operator", chunked_prefill_size=-1).server_info()
    assert (info["prefill_policy"], info["decode_policy"], info["preemption"]) == ("edf", "continuous", "operator")
    assert info["chunked_prefill_size"] == -1 and info["max_prefill_tokens"] == MAX_PREFILL_TOKENS
    assert info["schedule_policy"] == "fcfs" and info["internal_states"][0]["num_prefill_preemptions"] == 0
    assert make_engine().server_info()["chunked_prefill_size"] == make_engine().profile.chunked_prefill_size


# -- planning -------------------------------------------------------------------------------------------------
def test_fcfs_fills_the_chunk_in_arrival_order() -> None:
    engine = make_engine(chunked_prefill_size=8192)
    queue(engine, 3000, 4000, 5000)
    assert parts(batching.plan(engine)) == [("q0", 3000), ("q1", 4000), ("q2", 1192)]
    assert [r.rid for r in engine.queues.prefilling] == ["q0", "q1", "q2"]
    assert load(engine).used_tokens == 12000  # the whole prompts' KV, at admission ...
    assert engine.core.used_kv == 12000 + 3 * 4  # ... and room for their first output tokens (SGLang's reserve)


def test_edf_puts_the_tight_deadline_first() -> None:
    engine = make_engine(chunked_prefill_size=8192, prefill_policy="edf")
    queue(engine, 3000, 4000, 5000, slo_ttft_s=[math.inf, 10.0, 1.0])
    assert parts(batching.plan(engine)) == [("q2", 5000), ("q1", 3192)]
    assert engine.queues.waiting[0].rid == "q0"  # not planned: still waiting, no KV


def test_the_queue_is_in_arrival_order_admitted_or_not(local_policies: None) -> None:
    engine = make_engine(chunked_prefill_size=4096, prefill_policy="test-recording")
    reqs = queue(engine, 3000, 3000)
    batching.plan(engine)  # admits q0 (whole) and q1 (partial chunk)
    late = engine.submit(prompt_tokens=100, max_new_tokens=1, rid="late")
    late.arrival_s = reqs[0].arrival_s - 1.0  # e.g. dated back by poise_slo.waited_s
    batching.take_intake(engine)
    policy = engine.prefill_policy
    assert isinstance(policy, Recording)
    batching.plan(engine)
    assert policy.plans == [["q0", "q1"], ["late", "q0", "q1"]]


def test_admission_follows_plan_order_and_stops_at_the_first_that_does_not_fit() -> None:
    # KV for 10000 tokens (reserve = prompt + 4 output tokens in null mode). EDF ranks q2 (6000) first, then q1
    # (5000, does not fit next to q2), then q0 (1000, would fit but comes after q1 in plan order).
    engine = make_engine(chunked_prefill_size=16384, prefill_policy="edf", kv_capacity_tokens=10000)
    queue(engine, 1000, 5000, 6000, slo_ttft_s=[math.inf, 2.0, 1.0])
    assert parts(batching.plan(engine)) == [("q2", 6000)]
    assert [r.rid for r in engine.queues.waiting] == ["q0", "q1"]
    assert engine.core.used_kv == 6004  # prompt + min(max_new_tokens, num_reserved_decode_tokens)


def test_admitted_prompts_run_while_the_plans_head_waits_for_kv() -> None:
    # q0 is half prefilled and holds most of the KV; q1 (urgent, planned first) cannot be admitted: q0 still
    # computes its part of the plan.
    engine = make_engine(chunked_prefill_size=4096, prefill_policy="edf", kv_capacity_tokens=10000)
    q0, = queue(engine, 8000)
    assert parts(batching.plan(engine)) == [("q0", 4096)]
    q0.prefilled = 4096
    q1 = engine.submit(prompt_tokens=3000, max_new_tokens=1, rid="q1")
    q1.slo_ttft_s = 0.1
    batching.take_intake(engine)
    assert parts(batching.plan(engine)) == [("q0", 4096 - 3000)]
    assert q1.phase is Phase.WAITING


def test_without_chunking_prompts_run_whole_up_to_max_prefill_tokens() -> None:
    engine = make_engine(chunked_prefill_size=-1, context_length=131072)
    assert not engine.chunked and engine.chunk_size == MAX_PREFILL_TOKENS
    queue(engine, 60000, 10000, 3000)
    assert parts(batching.plan(engine)) == [("q0", 60000)]  # longer than the budget: alone, whole
    engine.queues.prefilling[0].prefilled = 60000
    engine.queues.prefilling.clear()
    assert parts(batching.plan(engine)) == [("q1", 10000), ("q2", 3000)]


@pytest.mark.asyncio
async def test_event_driven_policies_are_asked_on_arrivals_and_completions_only(local_policies: None) -> None:
    engine = make_engine(chunked_prefill_size=1000, prefill_policy="test-event", time_scale=0.5)  # ~20 ms a chunk
    policy = engine.prefill_policy
    assert isinstance(policy, EventDriven)
    async with running(engine):
        long = engine.submit(prompt_tokens=5000, max_new_tokens=1, ignore_eos=True, rid="long")
        await finish(engine, long)
        # 5 chunks of 1000, one plan: the engine kept computing the plan's prompt between events.
        assert len(policy.plans) == 1
        a = engine.submit(prompt_tokens=4000, max_new_tokens=1, ignore_eos=True, rid="a")
        await until(lambda: a.phase is Phase.PREFILLING)  # a's first chunk is running
        b = engine.submit(prompt_tokens=500, max_new_tokens=1, ignore_eos=True, rid="b")
        await finish(engine, a)
        await finish(engine, b)
        assert b.first_token_s is not None and a.first_token_s is not None and b.first_token_s < a.first_token_s
        # plans: long; a; b arrived (b first: shortest); b completed (a again). Not one per chunk.
        assert policy.plans[1:] == [["a"], ["a", "b"], ["a"]]
    assert sum(t for t, _ in policy.observed) == 5000 + 4000 + 500
    assert len(policy.observed) == 5 + 4 + 1 and all(s > 0 for _, s in policy.observed)


@pytest.mark.asyncio
async def test_a_waiting_policy_is_asked_again_at_its_retry_time(local_policies: None) -> None:
    engine = make_engine(prefill_policy="test-waits")
    policy = engine.prefill_policy
    assert isinstance(policy, WaitsFirst)
    async with running(engine):
        t0 = clock.monotonic()
        req = engine.submit(prompt_tokens=100, max_new_tokens=1, rid="held")
        await finish(engine, req, 2.0)
        assert req.first_token_s is not None
        assert WaitsFirst.hold_s <= req.first_token_s - t0 < WaitsFirst.hold_s + 0.1
        assert 2 <= len(policy.plans) <= 4  # no busy loop while waiting: asked at the arrival and at the retry


@pytest.mark.asyncio
async def test_decode_policy_selects_and_observes_every_step(local_policies: None) -> None:
    engine = make_engine(decode_policy="test-decode", time_scale=0.01)
    policy = engine.decode_policy
    assert isinstance(policy, RecordingDecode)
    async with running(engine):
        reqs = [engine.submit(prompt_tokens=100 * (i + 1), max_new_tokens=5, ignore_eos=True, rid=f"d{i}")
                for i in range(3)]
        for req in reqs:
            await finish(engine, req)
    assert policy.observed and all(s > 0 for *_, s in policy.observed)
    batch, longest, total, seconds = max(policy.observed)
    assert batch == 3 and longest >= 300 and total >= 600
    assert seconds == pytest.approx(engine.latency.decode_step_time_s(batch, total))


# -- operator-level preemption ---------------------------------------------------------------------------------
async def pd_pair_run(preemption: str, policy: str, *, time_scale: float = 0.2) -> dict[str, Any]:
    """A 60K prompt, then, once its prefill runs, a 500-token one with a tight TTFT target, through an in-process
    PD pair."""
    prefill = make_engine(mode="prefill", bootstrap_port=0, time_scale=time_scale, prefill_policy=policy,
                          preemption=preemption, chunked_prefill_size=-1)
    decode = make_engine(mode="decode", time_scale=time_scale)
    kv_used: list[int] = []
    apply, cut = prefill._apply, prefill._cut

    def checked(step: Any, *args: Any) -> None:
        (cut if args else apply)(step, *args)
        kv_used.append(load(prefill).used_tokens)
        assert load(prefill).used_tokens <= prefill.core.used_kv <= prefill.capacity

    prefill._apply = checked  # type: ignore[method-assign]
    prefill._cut = checked  # type: ignore[method-assign,assignment]
    async with running(prefill, decode):
        out: dict[str, Any] = {"prefill": prefill}

        def submit(n: int, rid: str, room: int, ttft_s: float) -> None:
            kw: dict[str, Any] = dict(prompt_tokens=n, max_new_tokens=4, ignore_eos=True, rid=rid,
                                      bootstrap_host="127.0.0.1", bootstrap_port=prefill.bootstrap_port,
                                      bootstrap_room=room, slo=RequestSlo(ttft_s=ttft_s))
            out[rid] = (prefill.submit(**kw), decode.submit(**kw))

        submit(60000, "long", 1, 30.0)
        await until(lambda: out["long"][0].phase is Phase.PREFILLING)
        submit(500, "short", 2, 0.2)
        for p, d in (out["long"], out["short"]):
            await finish(decode, d)
            await finish(prefill, p)
            assert len(d.output_ids) == 4 and p.finish == {"type": "length", "length": 0}
        assert prefill.core.used_kv == 0 and prefill.is_idle()
        out["metrics"] = prefill.metrics.render(prefill.gauges()).decode()
    out["kv_used"] = kv_used
    return out


# Deadline-driven policies rank the urgent prompt first (the SLO-aware ones when registered).
URGENT_FIRST = [p for p in ("edf", "sedf", "flowprefill") if p in PREFILL_POLICIES]


@pytest.mark.asyncio
@pytest.mark.parametrize("policy", URGENT_FIRST)
@REAL_TIME
async def test_operator_preemption_cuts_the_long_prefill_for_the_urgent_prompt(policy: str) -> None:
    out = await pd_pair_run("operator", policy)
    prefill: SimEngine = out["prefill"]
    (long_p, long_d), (short_p, short_d) = out["long"], out["short"]
    long_s = prefill.latency.prefill_time_s(60000)
    assert short_d.first_token_s < long_d.first_token_s - 0.5 * long_s
    assert short_p.first_token_s - short_p.arrival_s < 0.25 * long_s  # waited one operator, not the whole pass
    assert long_p.prefilled == 60000 and prefill.num_prefill_preemptions == 1
    assert prefill.total_prefill_tokens == 60500  # the cut pass's progress counted once, nothing lost or doubled
    assert "poise:prefill_preemptions_total{" in out["metrics"]
    assert any(line.startswith("poise:prefill_preemptions_total{") and line.endswith(" 1.0")
               for line in out["metrics"].splitlines())
    assert "poise:prefill_preemption_blocking_seconds_count{" in out["metrics"]


@pytest.mark.asyncio
@pytest.mark.parametrize("policy", ["fcfs", *URGENT_FIRST])
@REAL_TIME
async def test_chunk_preemption_never_cuts_a_pass(policy: str) -> None:
    out = await pd_pair_run("chunk", policy)
    prefill: SimEngine = out["prefill"]
    (long_p, _), (short_p, short_d) = out["long"], out["short"]
    long_s = prefill.latency.prefill_time_s(60000)
    # Unchunked, the 60K pass runs to its end: the urgent prompt waits for it.
    assert short_d.first_token_s > short_p.first_token_s > long_p.first_token_s
    assert short_p.first_token_s - short_p.arrival_s > 0.5 * long_s
    assert prefill.num_prefill_preemptions == 0 and prefill.total_prefill_tokens == 60500


@pytest.mark.parametrize("name", sorted(PREFILL_POLICIES))
@pytest.mark.parametrize("preemption", ["chunk", "operator"])
@pytest.mark.asyncio
@REAL_TIME
async def test_every_registered_prefill_policy_serves_a_pd_mix(name: str, preemption: str) -> None:
    # Whatever the registry holds when the tests run (fcfs, edf, and any SLO-aware policy added later):
    # every request finishes with all its tokens and the KV comes back.
    prefill = make_engine(mode="prefill", bootstrap_port=0, time_scale=0.002, prefill_policy=name,
                          preemption=preemption, chunked_prefill_size=2048)
    decode = make_engine(mode="decode", time_scale=0.002)
    async with running(prefill, decode):
        pairs = []
        for i in range(12):
            room = dict(bootstrap_host="127.0.0.1", bootstrap_port=prefill.bootstrap_port, bootstrap_room=100 + i)
            slo = RequestSlo(ttft_s=0.05 if i % 3 == 0 else 5.0, tpot_s=0.1, waited_s=0.01 * (i % 2))
            kw: dict[str, Any] = dict(prompt_tokens=300 + 1700 * (i % 4), max_new_tokens=6, ignore_eos=True,
                                      rid=f"m{i}", slo=slo, **room)
            pairs.append((prefill.submit(**kw), decode.submit(**kw)))
            await asyncio.sleep(0.002)
        for p, d in pairs:
            await finish(decode, d, 20)
            await finish(prefill, p, 20)
            assert len(d.output_ids) == 6
        assert prefill.core.used_kv == 0 and decode.core.used_kv == 0 and prefill.is_idle() and decode.is_idle()


@pytest.mark.parametrize("name", sorted(DECODE_BATCH_POLICIES))
@pytest.mark.parametrize("mode", ["null", "pd"])
@pytest.mark.asyncio
@REAL_TIME
async def test_every_registered_decode_policy_serves_requests(name: str, mode: str) -> None:
    # Whatever the registry holds (continuous, and any batch-selecting policy): every request gets all its
    # tokens and the KV comes back, colocated and behind a prefill peer.
    decode = make_engine(mode="decode" if mode == "pd" else "null", time_scale=0.01, decode_policy=name)
    prefill = make_engine(mode="prefill", bootstrap_port=0, time_scale=0.01) if mode == "pd" else None
    engines = [e for e in (prefill, decode) if e is not None]
    async with running(*engines):
        pending: list[tuple[SimEngine, SimRequest, int]] = []
        for i in range(10):
            kw: dict[str, Any] = dict(prompt_tokens=200 + 900 * (i % 3), max_new_tokens=12, ignore_eos=True,
                                      rid=f"dp{i}", slo=RequestSlo(ttft_s=5.0, tpot_s=0.02 + 0.05 * (i % 2)))
            if prefill is not None:
                kw.update(bootstrap_host="127.0.0.1", bootstrap_port=prefill.bootstrap_port, bootstrap_room=300 + i)
                pending.append((prefill, prefill.submit(**kw), 1))  # the prefill answers with the first token
            pending.append((decode, decode.submit(**kw), 12))
        for engine, req, tokens in pending:
            await finish(engine, req, 20)
            assert len(req.output_ids) == tokens
        assert all(e.core.used_kv == 0 and e.is_idle() for e in engines)


def test_operator_boundary_cut_keeps_the_elapsed_share_of_the_work() -> None:
    engine = make_engine(mode="prefill", time_scale=1.0)
    a = SimRequest(rid="a", prompt_tokens=1000, max_new_tokens=1, phase=Phase.PREFILLING)
    b = SimRequest(rid="b", prompt_tokens=999, max_new_tokens=1, prefilled=100,
                   phase=Phase.PREFILLING)
    engine.queues.prefilling.extend([a, b])
    step = batching.Step(time_s=1.0, prefill=[(a, 1000), (b, 899)])
    batching.cut(engine, step, 10.0, 10.3, 10.25)
    lat = engine.latency
    want_a, want_b = lat.prefill_tokens_done(1000, 0, 0.3), lat.prefill_tokens_done(899, 100, 0.3)
    assert (a.prefilled, b.prefilled) == (want_a, 100 + want_b)
    # Attention makes later tokens dearer, so 30% of the work covers a bit more than 30% of the tokens.
    assert 300 <= want_a < 330 and 269 <= want_b < 300
    assert engine.total_prefill_tokens == want_a + want_b and engine.num_prefill_preemptions == 1
    assert engine.core.replan


# -- poise_slo --------------------------------------------------------------------------------------------------
def test_poise_slo_is_parsed_on_every_generation_route() -> None:
    slo = {"slo_class": "chat", "ttft_s": 0.5, "tpot_s": 0.05, "waited_s": 0.2}
    gens = [P.parse_generate({"input_ids": [1, 2, 3], "poise_slo": slo}),
            P.parse_completion({"prompt": "hi", "poise_slo": slo}),
            P.parse_chat({"messages": [{"role": "user", "content": "hi"}], "poise_slo": slo})]
    for gen in gens:
        assert gen.slo == RequestSlo(slo_class="chat", ttft_s=0.5, tpot_s=0.05, waited_s=0.2)
    assert P.parse_generate({"input_ids": [1]}).slo is None
    for bad in ("fast", {"ttft_s": -1}, {"ttft_s": "x"}, {"waited_s": -0.1}):
        with pytest.raises(P.SchemaError) as exc:
            P.parse_completion({"prompt": "hi", "poise_slo": bad})
        assert exc.value.param == "poise_slo" and "poise_slo" in str(exc.value)


def test_poise_slo_sets_targets_and_dates_the_arrival_back() -> None:
    engine = make_engine()
    req = engine.submit(prompt_tokens=10, max_new_tokens=1, rid="s",
                        slo=RequestSlo(slo_class="batch", ttft_s=2.0, waited_s=0.75))
    assert (req.slo_class, req.slo_ttft_s, req.slo_tpot_s) == ("batch", 2.0, math.inf)
    assert req.arrival_s == pytest.approx(req.received_s - 0.75)
    plain = engine.submit(prompt_tokens=10, max_new_tokens=1, rid="p", priority=3)
    assert plain.arrival_s == plain.received_s and plain.slo_ttft_s == math.inf and plain.priority == 3


def test_policies_are_built_with_the_engines_latency_model(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[LatencyModel] = []

    def factory(model: LatencyModel) -> Recording:
        seen.append(model)
        return Recording()

    monkeypatch.setitem(PREFILL_POLICIES, "test-model", factory)
    engine = make_engine(prefill_policy="test-model", time_scale=0.5)
    other = make_engine(prefill_policy="test-model", time_scale=0.5)
    assert seen == [engine.latency, other.latency] and engine.prefill_policy is not other.prefill_policy
