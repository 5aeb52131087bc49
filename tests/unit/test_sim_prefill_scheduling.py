"""Prefill scheduling inside simulated engines: preemption granularity, event-driven policies, batching
timeouts, and the gateway's late-binding queue."""

from __future__ import annotations

from collections.abc import Sequence

import pytest

from loadgen.sim.baselines import make_mix
from loadgen.sim.overhead import NO_DELAY
from loadgen.sim.run import simulate
from loadgen.slo import SLO, parse_slo_classes
from loadgen.workload import TraceRequest, Workload
from shared.latency import LatencyModel, load_profile
from shared.policies import PREFILL_POLICIES, PrefillPlan
from shared.policies.prefill_order import Fcfs, PrefillItem, fill

LOOSE = SLO(ttft_s=60.0, tpot_s=1.0)
MODEL = LatencyModel(load_profile())


def labelled(*reqs: tuple[float, int, int, str]) -> Workload:
    return Workload(name="test", requests=[TraceRequest(index=i, arrival_s=t, input_tokens=n, output_tokens=o,
                                                        slo_class=c) for i, (t, n, o, c) in enumerate(reqs)])


CLASSES = parse_slo_classes(["urgent=0.3:1.0:0.5", "batch=60:1.0:0.5"], LOOSE)


def ttfts(result: object) -> list[float]:
    return [r.ttft_s for r in result.records]  # type: ignore[attr-defined]


def run(mix_kwargs: dict[str, object], w: Workload, split: str = "1P1D") -> object:
    mix = make_mix("static-minload", 2, split, **mix_kwargs)  # type: ignore[arg-type]
    return simulate(w, mix, MODEL, LOOSE, first_token_delay=NO_DELAY, slo_classes=CLASSES)


LONG_THEN_SHORT = labelled((0.0, 60000, 4, "batch"), (0.5, 500, 4, "urgent"))


def test_operator_preemption_lets_an_urgent_prompt_overtake_a_long_prefill() -> None:
    long_alone = MODEL.prefill_time_s(60000)
    fcfs = run({"prefill_policy": "fcfs", "chunk_tokens": 0}, LONG_THEN_SHORT)
    op = run({"prefill_policy": "edf", "preemption": "operator", "chunk_tokens": 0}, LONG_THEN_SHORT)
    # FCFS without chunks: the short prompt waits for the whole long prefill.
    assert ttfts(fcfs)[1] > long_alone - 0.5
    # EDF with operator-level preemption: it waits at most one operator (the longest: a 60K prompt's attention,
    # ~60 ms), then runs alone.
    one_operator_s = max(MODEL.operator_durations_s(long_alone / 32, MODEL.attention_share([(60000, 0)])))
    assert ttfts(op)[1] < MODEL.prefill_time_s(500) + one_operator_s + 0.01
    assert op.config["preemptions"]["count"] == 1  # type: ignore[attr-defined]
    assert op.config["preemptions"]["blocking_ms_max"] <= one_operator_s * 1e3 + 1e-6  # type: ignore[attr-defined]
    # The long prompt keeps the work done before the cut: it finishes about one short prefill later than alone.
    assert ttfts(op)[0] < ttfts(fcfs)[0] + MODEL.prefill_time_s(500) + 0.05
    assert all(r.ok for r in op.records)  # type: ignore[attr-defined]


def test_chunk_preemption_switches_only_at_chunk_boundaries() -> None:
    edf_chunked = run({"prefill_policy": "edf", "chunk_tokens": 8192}, LONG_THEN_SHORT)
    # It waits for the chunk in flight (late chunks of a long prompt are the slowest), not the whole prompt.
    last_chunk = MODEL.prefill_time_s(8192, 60000 - 8192)
    assert ttfts(edf_chunked)[1] < last_chunk + MODEL.prefill_time_s(500) + 0.05
    assert ttfts(edf_chunked)[1] > 0.05  # it did wait for a boundary
    assert edf_chunked.config["preemptions"]["count"] == 0  # type: ignore[attr-defined]


class CountingEventDriven:
    """EDF, asked only on events: counts how often the engine asks."""

    name = "counting-event-driven"
    event_driven = True
    calls = 0

    def plan(self, queue: Sequence[PrefillItem], budget: int, now_s: float) -> PrefillPlan:  # type: ignore[type-arg]
        CountingEventDriven.calls += 1
        return PrefillPlan(fill(sorted(queue, key=lambda r: r.arrival_s + r.slo_ttft_s), budget))

    def observe(self, tokens: int, seconds: float) -> None:
        return None


def test_event_driven_policies_are_asked_only_on_arrivals_and_completions(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(PREFILL_POLICIES, CountingEventDriven.name, lambda model: CountingEventDriven())
    CountingEventDriven.calls = 0
    # One 40K prompt in 2K chunks: 20 passes, but only its arrival and its completion are events.
    w = labelled((0.0, 40000, 2, "batch"))
    result = run({"prefill_policy": CountingEventDriven.name, "chunk_tokens": 2048}, w)
    assert all(r.ok for r in result.records)  # type: ignore[attr-defined]
    assert CountingEventDriven.calls <= 3, CountingEventDriven.calls


class WaitThenFcfs(Fcfs):
    """Holds prompts until 1 s after the first arrival (a batching timeout), then serves them in one pass."""

    name = "wait-then-fcfs"

    def plan(self, queue: Sequence[PrefillItem], budget: int, now_s: float) -> PrefillPlan:  # type: ignore[type-arg]
        start = min(r.arrival_s for r in queue) + 1.0
        if now_s < start:
            return PrefillPlan([], retry_at_s=start)
        return PrefillPlan(fill(queue, budget))


def test_a_policy_that_waits_is_woken_at_its_retry_time(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(PREFILL_POLICIES, WaitThenFcfs.name, lambda model: WaitThenFcfs())
    w = labelled((0.0, 200, 2, "batch"), (0.2, 200, 2, "batch"))
    result = run({"prefill_policy": WaitThenFcfs.name}, w)
    firsts = [r.first_token_s for r in result.records]  # type: ignore[attr-defined]
    assert all(f is not None and 1.0 <= f < 1.2 for f in firsts), firsts
    assert abs(firsts[0] - firsts[1]) < 0.02  # one prefill pass (the decode side joins them a step apart)


def test_late_binding_orders_prompts_the_engine_cannot_reorder() -> None:
    # A burst on one prefill engine that runs FCFS: half urgent, half batch, batch ones first in arrival.
    reqs = [(i * 0.001, 3000, 4, "batch") for i in range(20)] + [(0.03 + i * 0.001, 3000, 4, "urgent") for i in range(5)]
    w = labelled(*reqs)
    classes = parse_slo_classes(["urgent=1.0:1.0:0.5", "batch=60:1.0:0.5"], LOOSE)
    plain = simulate(w, make_mix("static-minload", 2, "1P1D"), MODEL, LOOSE, first_token_delay=NO_DELAY,
                     slo_classes=classes)
    late = simulate(w, make_mix("static-minload", 2, "1P1D", late_binding="edf", late_binding_depth=1), MODEL, LOOSE,
                    first_token_delay=NO_DELAY, slo_classes=classes)
    assert plain.summary.per_class["urgent"].ttft_attainment < 0.5
    assert late.summary.per_class["urgent"].ttft_attainment == 1.0
    assert all(r.ok for r in late.records)
    assert late.config["policies"]["late_binding"] == ["edf", 1]


def test_a_plan_whose_head_waits_for_kv_lets_the_admitted_prompts_finish() -> None:
    import msgspec

    # 12K tokens of KV per engine: a 9K prompt is being chunked when an urgent 4K prompt arrives (to the
    # other decode engine, so its decode KV is free). EDF puts the 4K one first, but it cannot be admitted
    # until the 9K one, which holds the prefill KV, is done: the engine must finish that one, not stall.
    small = LatencyModel(msgspec.structs.replace(load_profile(), kv_capacity_tokens=12000))
    w = labelled((0.0, 9000, 4, "batch"), (0.1, 4000, 4, "urgent"))
    result = simulate(w, make_mix("static-minload", 3, "1P2D", prefill_policy="edf", chunk_tokens=2048), small,
                      LOOSE, first_token_delay=NO_DELAY, slo_classes=CLASSES)
    assert all(r.ok for r in result.records)
    assert ttfts(result)[1] > ttfts(result)[0] - 0.1  # served after the long one, which held the KV


def test_decode_kv_reserved_at_dispatch_orders_prompts_first_come_unless_the_gateway_holds_them() -> None:
    import msgspec

    # The prefill engine orders prompts itself (EDF), but SGLang's decode side reserves KV at dispatch, first
    # come first served: with room for 9 prompts, the urgent ones wait behind batch ones for decode KV before
    # the prefill engine ever sees them. Held at the gateway (late binding), a prompt reserves nothing until
    # its turn, and the urgent ones go first.
    small = LatencyModel(msgspec.structs.replace(load_profile(), kv_capacity_tokens=28_000))
    reqs = [(i * 0.001, 3000, 4, "batch") for i in range(20)] + [(0.03 + i * 0.001, 3000, 4, "urgent") for i in range(5)]
    classes = parse_slo_classes(["urgent=1.0:1.0:0.5", "batch=60:1.0:0.5"], LOOSE)

    def urgent_in_time(**kw: object) -> float:
        mix = make_mix("static-minload", 2, "1P1D", prefill_policy="edf", **kw)  # type: ignore[arg-type]
        result = simulate(labelled(*reqs), mix, small, LOOSE, first_token_delay=NO_DELAY, slo_classes=classes)
        assert all(r.ok for r in result.records)
        return result.summary.per_class["urgent"].ttft_attainment

    assert urgent_in_time() < 0.5
    assert urgent_in_time(late_binding="edf") == 1.0



def test_a_refused_release_does_not_leave_the_rest_held() -> None:
    # Depth 1: when the first prompt's prefill ends, the queue's turn goes to a prompt no engine can hold (a
    # 400). Its slot is still free, so the next held prompt must go out in the same round: no later event
    # would release it (the gateway's queue pumps until the slots are taken or the policy holds the rest).
    reqs = [(0.0, 8000, 4, "batch"), (0.01, 500_000, 4, "batch"), (0.02, 1000, 4, "batch")]
    result = run({"late_binding": "edf", "late_binding_depth": 1}, labelled(*reqs))
    records = sorted(result.records, key=lambda r: r.index)  # type: ignore[attr-defined]
    assert [r.ok for r in records] == [True, False, True]
    assert (records[1].error or "").startswith("400")
