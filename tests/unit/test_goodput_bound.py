"""The goodput bound: its arithmetic on hand-made loads, and no simulated policy ever beating it."""

from __future__ import annotations

import pytest

from loadgen.goodput_bound import attainment_bound, goodput_bound, miss_bound, request_work_s
from loadgen.sim.baselines import make_mix
from loadgen.sim.goodput import Yardstick
from loadgen.sim.run import simulate
from loadgen.slo import SLO, slo_for
from loadgen.traces import load_trace
from loadgen.workload import TraceRequest
from shared.latency import LatencyModel, LatencyProfile, load_profile

MODEL = LatencyModel(load_profile())
# Linear prompts, 1 ms a token, decode free: a request's work is its prompt length in milliseconds.
LINEAR = LatencyModel(LatencyProfile(
    name="linear", model="m", gpu="g", prefill_overhead_s=0.01, prefill_s_per_token=1e-3, prefill_s_per_token2=0.0,
    decode_overhead_s=0.0, decode_s_per_seq=0.0, decode_s_per_context_token=0.0, kv_bytes_per_token=1,
    kv_capacity_tokens=10**6, max_running_requests=8))
ONE_S = SLO(ttft_s=1.0, tpot_s=1.0)


def burst(*prompts: int, at: float = 0.0) -> list[TraceRequest]:
    return [TraceRequest(index=i, arrival_s=at, input_tokens=n, output_tokens=1) for i, n in enumerate(prompts)]


def test_a_request_costs_its_prompt_and_each_later_tokens_share_of_a_full_step() -> None:
    p = MODEL.profile
    prompt, whole = request_work_s(MODEL, 1000, 4)
    assert prompt == pytest.approx(MODEL.prefill_work_s(1000))
    steps = sum(p.decode_s_per_seq + p.decode_s_per_context_token * (1000 + j)
                + p.decode_overhead_s / p.max_running_requests for j in (1, 2, 3))
    assert whole == pytest.approx(prompt + steps)
    assert request_work_s(MODEL, 1000, 1) == (prompt, prompt)  # the first token comes with the prompt


def test_one_gpu_serves_what_fits_in_the_ttft_target_largest_requests_given_up_first() -> None:
    # Ten 0.3 s prompts at once, a 1 s TTFT target, one GPU: three fit, seven must miss.
    bound = miss_bound(burst(*[300] * 10), LINEAR, ONE_S, 1)
    assert (bound.counted, bound.misses, bound.attainment) == (10, 7, pytest.approx(0.3))
    # One 0.9 s prompt and three 0.3 s ones: giving up the long one leaves 0.9 s, which fits.
    assert miss_bound(burst(900, 300, 300, 300), LINEAR, ONE_S, 1).misses == 1
    # Twice the GPUs, twice the work.
    assert miss_bound(burst(*[300] * 10), LINEAR, ONE_S, 2).misses == 4


def test_a_prompt_longer_than_the_target_misses_anywhere_and_the_warm_up_is_not_counted() -> None:
    reqs = [TraceRequest(index=0, arrival_s=0.0, input_tokens=5000, output_tokens=1),
            TraceRequest(index=1, arrival_s=10.0, input_tokens=1500, output_tokens=1),
            TraceRequest(index=2, arrival_s=10.0, input_tokens=100, output_tokens=1)]
    bound = miss_bound(reqs, LINEAR, ONE_S, 64, warmup_s=5.0)
    assert (bound.counted, bound.infeasible, bound.over_capacity) == (2, 1, 0)


def test_requests_spread_over_time_are_judged_window_by_window() -> None:
    # A 0.8 s prompt every 2 s never overloads one GPU; ten at once every 60 s do, in every burst.
    steady = [TraceRequest(index=i, arrival_s=2.0 * i, input_tokens=800, output_tokens=1) for i in range(30)]
    assert miss_bound(steady, LINEAR, ONE_S, 1).misses == 0
    bursts = [r for k in range(3) for r in burst(*[300] * 10, at=60.0 * k)]
    bursts = [TraceRequest(index=i, arrival_s=r.arrival_s, input_tokens=r.input_tokens, output_tokens=1)
              for i, r in enumerate(bursts)]
    assert miss_bound(bursts, LINEAR, ONE_S, 1).misses == 21


def test_the_bound_only_falls_as_the_load_rises_and_the_search_finds_its_edge() -> None:
    w = load_trace("azure-conv").slice(0.0, 600.0)
    slo = slo_for("azure-conv")
    at = [attainment_bound(w, MODEL, slo, 2, s).attainment for s in (1.0, 4.0, 16.0, 32.0)]
    assert at == sorted(at, reverse=True) and at[0] == 1.0 and at[-1] < 0.9
    found = goodput_bound(w, MODEL, slo, 2, bisections=3)
    passing = [s for s, b in found.points if b.attainment >= 0.9]
    assert max(passing) == found.goodput_scale
    assert all(s > found.goodput_scale for s, b in found.points if b.attainment < 0.9)


@pytest.mark.parametrize("policy, split", [("static-minload", "1P1D"), ("colocated", None), ("poise", "1P1D")])
def test_no_simulated_policy_beats_the_bound(policy: str, split: str | None) -> None:
    # Far past what two GPUs serve, where the bound bites: the simulator must land at or below it (a
    # simulated engine that did work for free would not).
    w = load_trace("azure-conv").slice(0.0, 300.0)
    slo = slo_for("azure-conv")
    y = Yardstick(warmup_s=60.0)
    scale = 16.0
    bound = attainment_bound(w, MODEL, slo, 2, scale, y)
    assert bound.attainment < 1.0
    run = simulate(w, make_mix(policy, 2, split), MODEL, slo, rate_scale=scale, rate_mode=y.rate_mode,
                   warmup_s=y.warmup_for(w, scale), seed=y.seed)
    assert len([r for r in run.records if r.arrival_s >= y.warmup_for(w, scale)]) == bound.counted
    assert run.summary.slo_attainment <= bound.attainment


def test_long_contexts_share_a_steps_overhead_by_the_kv_they_read() -> None:
    p = MODEL.profile
    _, by_batch = request_work_s(MODEL, 20_000, 3, "batch")
    _, by_kv = request_work_s(MODEL, 20_000, 3, "kv")
    context = 20_001 + 20_002
    assert by_kv - by_batch == pytest.approx(p.decode_overhead_s * (context / p.kv_capacity_tokens - 2 / p.max_running_requests))
