"""Early rejection (shared/policies/admission.py) and the rate it reads (shared/event_rate.py): the policy
table-driven, then the simulated cluster past its decode capacity."""

from __future__ import annotations

from typing import Any

import pytest

from loadgen.sim.baselines import make_mix
from loadgen.sim.overhead import NO_DELAY
from loadgen.sim.run import simulate
from loadgen.slo import SLO
from loadgen.workload import TraceRequest, Workload
from shared.event_rate import EventRate
from shared.latency import LatencyModel, load_profile
from shared.policies import DispatchPolicy, EngineView, LeastLoad, Placement, Rejection, RequestView
from shared.policies.admission import EarlyRejection, EarlyRejectionParams, decode_wait_s
from shared.policies.local_prefill import LocalPrefill

_: DispatchPolicy = EarlyRejection(LeastLoad(), 2.0)  # the Protocol check mypy runs

REQ = RequestView(rid="r", input_tokens=1000, max_output_tokens=100)


def eng(instance_id: str, role: str = "decode", **kw: Any) -> EngineView:
    base: dict[str, Any] = {"status": "ready", "kv_capacity_tokens": 100_000, "max_running_requests": 64, "load_age_s": 0.1}
    base.update(kw)
    return EngineView(instance_id=instance_id, role=role, **base)  # type: ignore[arg-type]


def test_event_rate_needs_enough_events_inside_its_window() -> None:
    rate = EventRate(window_s=10.0, min_events=3)
    for t in (0.0, 1.0):
        rate.record(t)
    assert rate.rate(1.0) is None  # two events: not trusted yet
    rate.record(2.0)
    assert rate.rate(2.0) == pytest.approx(0.3)
    rate.record(9.0)
    assert rate.rate(10.5) == pytest.approx(0.3)  # the first event left the window
    assert rate.rate(11.5) is None  # the second too: 2 of the 3 needed


@pytest.mark.parametrize("kw", [{"window_s": 0.0}, {"min_events": 0}])
def test_event_rate_refuses_a_bad_window(kw: dict[str, float]) -> None:
    with pytest.raises(ValueError):
        EventRate(**kw)  # type: ignore[arg-type]


@pytest.mark.parametrize("engine, wait", [
    (eng("d0", kv_waiting_reqs=3, finish_rate_rps=0.1), 0.0),  # a short queue is not judged
    (eng("d0", kv_waiting_reqs=40), None),  # a long queue without a measured rate: nothing to judge on
    (eng("d0", kv_waiting_reqs=40, finish_rate_rps=2.0), 20.0),
])
def test_decode_wait(engine: EngineView, wait: float | None) -> None:
    assert decode_wait_s(engine, EarlyRejectionParams()) == wait


def cluster(d0_waiting: int, d1_waiting: int, rate: float | None = 2.0) -> list[EngineView]:
    # d0 has the least KV in use, so least-load picks it; d1 is the fuller one.
    return [eng("p0", "prefill"), eng("d0", used_tokens=0, kv_waiting_reqs=d0_waiting, finish_rate_rps=rate),
            eng("d1", used_tokens=50_000, kv_waiting_reqs=d1_waiting, finish_rate_rps=rate)]


def test_a_request_the_backlog_makes_late_is_refused_with_a_retryable_429() -> None:
    policy = EarlyRejection(LeastLoad(), ttft_slo_s=2.0)
    # 40 waiting at 2/s: 20 s before it could start; judged once the queue has lasted a second.
    assert isinstance(policy.place(REQ, cluster(40, 40), 0.0), Placement)
    assert isinstance(policy.place(REQ, cluster(40, 40), 0.9), Placement)
    decision = policy.place(REQ, cluster(40, 40), 1.0)
    assert isinstance(decision, Rejection) and decision.retryable and decision.code == "slo_unreachable"
    assert "d0" in decision.reason and "20 s" in decision.reason and "2.0 s" in decision.reason


def test_the_request_s_own_target_and_the_factor_decide() -> None:
    patient = RequestView(rid="r", input_tokens=1000, max_output_tokens=100, slo_ttft_s=30.0)
    policy = EarlyRejection(LeastLoad(), 2.0, EarlyRejectionParams(persist_s=0.0))
    assert isinstance(policy.place(patient, cluster(40, 40), 0.0), Placement)
    assert isinstance(policy.place(REQ, cluster(40, 40), 0.0), Rejection)
    lenient = EarlyRejection(LeastLoad(), 2.0, EarlyRejectionParams(factor=15.0, persist_s=0.0))
    assert isinstance(lenient.place(REQ, cluster(40, 40), 0.0), Placement)


def test_another_decode_engine_that_starts_it_in_time_takes_it() -> None:
    policy = EarlyRejection(LeastLoad(), ttft_slo_s=2.0, params=EarlyRejectionParams(persist_s=0.0))
    assert policy.place(REQ, cluster(40, 2), 0.0) == Placement(prefill_id="p0", decode_id="d1", stages=("redirected",))


def test_a_queue_that_does_not_last_is_not_judged() -> None:
    """A burst between two steps (the queue is short again at the next dispatch) restarts the clock."""
    policy = EarlyRejection(LeastLoad(), ttft_slo_s=2.0)
    for t in (0.0, 0.6):
        assert isinstance(policy.place(REQ, cluster(40, 40), t), Placement)
        assert isinstance(policy.place(REQ, cluster(0, 0), t + 0.1), Placement)
    assert isinstance(policy.place(REQ, cluster(40, 40), 1.5), Placement)  # a new queue, 0 s old
    assert isinstance(policy.place(REQ, cluster(40, 40), 2.5), Rejection)


@pytest.mark.parametrize("engines", [
    cluster(2, 40),  # the chosen engine keeps up
    cluster(40, 40, rate=None),  # no measured rate: never refuse on a guess
    [eng("c0", "null", kv_waiting_reqs=400, waiting_reqs=2, finish_rate_rps=0.1)],  # a colocated engine: its
    # waiting queue is what a request waits behind, and it is short
])
def test_requests_pass_when_there_is_nothing_to_refuse_on(engines: list[EngineView]) -> None:
    policy = EarlyRejection(LeastLoad(), ttft_slo_s=2.0)
    assert policy.place(REQ, engines, 0.0) == LeastLoad().place(REQ, engines, 0.0)  # placed as without the rule


def test_a_colocated_engine_is_judged_by_its_waiting_queue_and_another_colocated_one_may_take_it() -> None:
    policy = EarlyRejection(LeastLoad(), ttft_slo_s=2.0, params=EarlyRejectionParams(persist_s=0.0))
    assert decode_wait_s(eng("c0", "null", waiting_reqs=40, finish_rate_rps=4.0), EarlyRejectionParams()) == 10.0
    full = [eng("c0", "null", used_tokens=0, waiting_reqs=40, finish_rate_rps=4.0),
            eng("c1", "null", used_tokens=50_000, waiting_reqs=40, finish_rate_rps=4.0)]
    decision = policy.place(REQ, full, 0.0)
    assert isinstance(decision, Rejection) and decision.retryable and decision.code == "slo_unreachable"
    assert "colocated engine c0" in decision.reason and "10 s" in decision.reason
    room = [full[0], eng("c1", "null", used_tokens=50_000, waiting_reqs=3, finish_rate_rps=4.0)]
    assert policy.place(REQ, room, 0.0) == Placement(prefill_id=None, decode_id="c1", stages=("redirected",))


def test_colocated_engines_are_left_alone_when_not_judged_but_decode_engines_are_not() -> None:
    policy = EarlyRejection(LeastLoad(), ttft_slo_s=2.0, params=EarlyRejectionParams(persist_s=0.0, colocated=False))
    full = [eng("c0", "null", waiting_reqs=40, finish_rate_rps=4.0)]
    assert policy.place(REQ, full, 0.0) == Placement(prefill_id=None, decode_id="c0")
    assert isinstance(policy.place(REQ, cluster(40, 40), 0.0), Rejection)


def test_a_locally_prefilled_request_moves_only_to_an_engine_that_prefills() -> None:
    short = RequestView(rid="r", input_tokens=100, max_output_tokens=100)
    engines = [eng("p0", "prefill"), eng("d0", kv_waiting_reqs=40, finish_rate_rps=2.0, local_prefill=True),
               eng("d1", used_tokens=50_000, kv_waiting_reqs=0, local_prefill=False)]
    policy = EarlyRejection(LocalPrefill(LeastLoad()), ttft_slo_s=2.0, params=EarlyRejectionParams(persist_s=0.0))
    assert isinstance(policy.place(short, engines, 0.0), Rejection)
    engines[2] = eng("d1", used_tokens=50_000, kv_waiting_reqs=0, local_prefill=True)
    assert policy.place(short, engines, 0.0) == Placement(prefill_id=None, decode_id="d1",
                                                          stages=("local-prefill", "redirected"))


@pytest.mark.parametrize("kw", [{"factor": 0.0}, {"standing_factor": 0.0}, {"min_queue": 0}, {"persist_s": -1.0}])
def test_bad_params_are_refused(kw: dict[str, float]) -> None:
    with pytest.raises(ValueError):
        EarlyRejectionParams(**kw)  # type: ignore[arg-type]


def test_other_refusals_pass_through() -> None:
    decision = EarlyRejection(LeastLoad(), 2.0).place(REQ, [], 0.0)
    assert isinstance(decision, Rejection) and not decision.retryable


def test_a_standing_queue_is_held_to_half_the_target() -> None:
    """A queue that rose past half the target and has not drained for standing_s is refused at half the
    target; once it drains, a passing burst may queue up to the whole target again."""
    policy = EarlyRejection(LeastLoad(), ttft_slo_s=20.0, params=EarlyRejectionParams(persist_s=0.0))
    at = lambda waiting: [eng("p0", "prefill"), eng("d0", kv_waiting_reqs=waiting, finish_rate_rps=2.0)]  # noqa: E731
    assert isinstance(policy.place(REQ, at(30), 0.0), Placement)  # 15 s: a burst may wait up to 20 s
    assert isinstance(policy.place(REQ, at(30), 29.0), Placement)
    assert isinstance(policy.place(REQ, at(18), 29.5), Placement)  # 9 s: under the line, not drained
    assert isinstance(policy.place(REQ, at(30), 30.0), Rejection)  # 15 s after 30 s standing: over 10 s
    assert isinstance(policy.place(REQ, at(18), 31.0), Placement)  # 9 s: within half the target
    assert isinstance(policy.place(REQ, at(2), 40.0), Placement)  # drained
    assert isinstance(policy.place(REQ, at(30), 41.0), Placement)  # a new burst: the whole target again


def long_context_load(gap_s: float, duration_s: float) -> Workload:
    """Long prompts and outputs whose decode KV runs out before the prefill side does (Mooncake's shape)."""
    return Workload(name="test", requests=[TraceRequest(index=i, arrival_s=i * gap_s, input_tokens=16_000,
                                                        output_tokens=1500) for i in range(int(duration_s / gap_s))])


def test_past_the_decode_side_s_capacity_the_simulated_cluster_keeps_serving_in_time() -> None:
    """2P1D past its decode capacity: without early rejection the prealloc queue grows for the whole run and
    nearly every request waits past its target; with it the refused ones go at once and the rest are in
    time. Within capacity nothing is refused."""
    model, slo = LatencyModel(load_profile()), SLO(ttft_s=20.0, tpot_s=0.1)
    over = long_context_load(1.5, 1200.0)
    results = {er: simulate(over, make_mix("static-minload", 3, "2P1D", early_rejection=er), model, slo,
                            first_token_delay=NO_DELAY) for er in (False, True)}
    assert results[False].summary.slo_attainment < 0.3
    refused = [r for r in results[True].records if not r.ok]
    assert refused and all((r.error or "").startswith("429: early rejection") for r in refused)
    assert results[True].config["early_rejections"] == len(refused) < 0.3 * len(over.requests)
    taken = [r for r in results[True].records if r.ok]
    assert sum(r.first_token_s is not None and r.first_token_s - r.arrival_s <= slo.ttft_s for r in taken) >= 0.95 * len(taken)
    within = simulate(long_context_load(2.5, 600.0), make_mix("static-minload", 3, "2P1D", early_rejection=True),
                      model, slo, first_token_delay=NO_DELAY)
    assert within.config["early_rejections"] == 0 and within.summary.slo_attainment == 1.0


def test_colocated_engines_that_give_up_late_prompts_serve_the_rest_in_time() -> None:
    """Two colocated engines with Poise's prefill order, past their prefill capacity: left queued, prompts that
    waited out their target are served late in the slack of ones that still had time, some of them tens of
    seconds late; given up (``give_up_late``), each is refused with a retryable 429 at its target instead,
    the rest meet their target and no fewer requests are in time. Within capacity nothing is given up. (The
    TPOT target is loose: unchunked prompts stall the decode steps between them, and give-up is about the
    wait for the first token.)"""
    model, slo = LatencyModel(load_profile()), SLO(ttft_s=2.0, tpot_s=0.5)

    def load(gap_s: float) -> Workload:
        return Workload(name="test", requests=[
            TraceRequest(index=i, arrival_s=i * gap_s, input_tokens=4000 + (i * 7919) % 4000, output_tokens=50)
            for i in range(int(120 / gap_s))])

    def run(gap_s: float, give_up: bool):  # type: ignore[no-untyped-def]
        mix = make_mix("colocated", 2, prefill_policy="flowprefill-fewest-late", preemption="operator", chunk_tokens=0,
                       give_up_late=give_up)
        return simulate(load(gap_s), mix, model, slo, first_token_delay=NO_DELAY)

    kept, given_up = run(0.085, False), run(0.085, True)
    assert kept.config["early_rejections"] == 0 and kept.summary.ttft_p99_s > 10 * slo.ttft_s
    refused = [r for r in given_up.records if not r.ok]
    assert refused and all((r.error or "").startswith("429: early rejection: waited") for r in refused)
    assert given_up.config["early_rejections"] == len(refused)
    assert given_up.summary.ttft_p99_s < 1.25 * slo.ttft_s
    assert given_up.summary.slo_attainment >= kept.summary.slo_attainment - 0.01
    within = run(0.2, True)
    assert within.config["early_rejections"] == 0 and within.summary.slo_attainment == 1.0
