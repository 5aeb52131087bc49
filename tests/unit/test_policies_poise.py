"""Poise's P:D controller: the capacity model it scores splits with, and the rules that keep it stable."""

from __future__ import annotations

import math

import msgspec
import pytest

from loadgen.sim.baselines import make_mix
from loadgen.sim.cluster import SimCluster, SimCosts
from loadgen.sim.events import PRIORITY_ARRIVAL, EventQueue
from loadgen.sim.goodput import Yardstick, curve_point, max_flips_in_window
from loadgen.sim.instance import SimRequest
from loadgen.sim.run import simulate
from loadgen.slo import slo_for
from loadgen.traces import load_trace
from shared.latency import LatencyModel, load_profile
from shared.policies import ArrowDispatch, EngineView, LeastLoad, Placement, PolicyContext, RequestView
from shared.policies.poise import PoiseParams, PoisePools, mix_of, window_tpot_p90, worth_a_flip
from shared.policies.split_capacity import (
    Mix,
    best_split,
    colocated_load,
    decode_rho,
    kv_tokens_bound,
    prefill_kv_seconds,
    prefill_seconds,
    split_loads,
)
from shared.protocol.messages import ClusterSnapshot, InstanceInfo, InstanceLoad, LoadReport, SeriesPoint

MODEL = LatencyModel(load_profile())
CTX = PolicyContext(ttft_slo_s=2.0, tpot_slo_s=0.15, max_instances=8)


def split_params(**changes: float) -> PoiseParams:
    """The split rules alone: these tests score P:D splits, colocated serving has its own."""
    return PoiseParams(colocated=False, **changes)  # type: ignore[arg-type]


def equal_lengths(rate: float, isl: float, osl: float) -> Mix:
    return Mix(rate_rps=rate, isl=isl, osl=osl, isl_sq=isl * isl, osl_sq=osl * osl, isl_osl=isl * osl)


def test_prefill_seconds_is_the_latency_models_time_for_equal_prompts() -> None:
    assert prefill_seconds(MODEL, equal_lengths(1.0, 3000, 10)) == pytest.approx(MODEL.prefill_time_s(3000))
    # A spread of lengths costs more than its mean: the quadratic term reads E[L^2].
    spread = Mix(rate_rps=1.0, isl=3000, osl=10, isl_sq=2 * 3000**2, osl_sq=100, isl_osl=30000)
    assert prefill_seconds(MODEL, spread) > MODEL.prefill_time_s(3000)


def test_decode_load_reaches_one_where_the_step_reaches_the_tpot_slo() -> None:
    mix = equal_lengths(1.0, 1000, 200)
    slo = 0.02  # tight enough that the step time binds before KV or the running-request cap
    # Find the rate at which one decode instance is exactly full, then check the steady state it implies: n
    # requests of mean context ISL + OSL/2 in a batch whose step takes the SLO, so n = rate * OSL * SLO.
    rate = 1.0 / decode_rho(MODEL, mix, 1, slo)
    n = rate * 200 * slo
    assert n < MODEL.profile.max_running_requests and n * 1200 < MODEL.profile.kv_capacity_tokens
    assert MODEL.decode_step_time_s(1, 0) + (n - 1) * MODEL.profile.decode_s_per_seq + \
        MODEL.profile.decode_s_per_context_token * n * (1000 + 100) == pytest.approx(slo, rel=0.02)
    assert decode_rho(MODEL, msgspec.structs.replace(mix, rate_rps=2 * rate), 2, slo) == pytest.approx(1.0)
    # At the chat SLO this mix fills the 256-request cap first: its load is the cap's share.
    loose = decode_rho(MODEL, mix, 1, 0.15)
    step = min(MODEL.decode_step_time_s(1, 0) / (1 - 1.0 * (2e-5 * 200 + 5.2e-8 * 220_000)), 0.15)
    assert loose >= 1.0 * step * 200 / MODEL.profile.max_running_requests


def test_the_best_split_follows_the_mix() -> None:
    code = split_loads(MODEL, equal_lengths(20.0, 2048, 28), 8, 0.1)
    chat_long = split_loads(MODEL, equal_lengths(20.0, 300, 1000), 8, 0.15)
    assert best_split(code).prefill == 7  # long prompts, a few output tokens: prefill-heavy
    assert best_split(chat_long).prefill <= 2  # short prompts, long answers: decode-heavy
    # Near-equal scores: the split closest to where the cluster is wins (no flip for nothing).
    flat = [msgspec.structs.replace(s, score=0.5) for s in code]
    assert best_split(flat, current=4).prefill == 4


def inst(i: str, role: str, *, status: str = "ready", waiting: int = 0, waiting_tokens: int = 0) -> InstanceLoad:
    info = InstanceInfo(instance_id=i, role=role, status=status, engine_kind="sim", url="sim://x",  # type: ignore[arg-type]
                        bootstrap_host="", bootstrap_port=None, model="m", profile="p", kv_capacity_tokens=380_000,
                        max_running_requests=256, sidecar="sim", registered_at_unix_s=0.0)
    load = LoadReport(instance_id=i, role=role, status=status, ts_unix_s=0.0,  # type: ignore[arg-type]
                      num_waiting_reqs=waiting, num_waiting_uncached_tokens=waiting_tokens)
    return InstanceLoad(info=info, load=load, load_age_s=0.0)


def series(isl: float, osl: float, rate: float, until: float = 120.0) -> list[SeriesPoint]:
    n = int(rate * 5)
    return [SeriesPoint(start_unix_s=t, interval_s=5.0, arrivals=n, arrival_rate_rps=rate, completed=n,
                        mean_input_tokens=isl, mean_output_tokens=osl, mean_running_reqs=10.0, ttft_p90_s=None,
                        tpot_p90_s=None, mean_input_tokens_sq=isl * isl, mean_output_tokens_sq=osl * osl,
                        mean_input_output_tokens=isl * osl) for t in range(0, int(until), 5)]


def cluster(prefill: int, decode: int, **changes: str) -> list[InstanceLoad]:
    out = [inst(f"p{i}", "prefill") for i in range(prefill)] + [inst(f"d{i}", "decode") for i in range(decode)]
    return [inst(i.info.instance_id, i.info.role, status=changes[i.info.instance_id]) if i.info.instance_id in changes
            else i for i in out]


def snap(instances: list[InstanceLoad], points: list[SeriesPoint]) -> ClusterSnapshot:
    return ClusterSnapshot(ts_unix_s=0.0, instances=instances, series=points)


def test_mix_of_reads_the_window_and_reads_missing_moments_as_equal_lengths() -> None:
    mix = mix_of(series(2000, 30, 4.0), 60.0)
    assert mix is not None and mix.rate_rps == pytest.approx(4.0) and mix.isl_sq == pytest.approx(4e6)
    old = [msgspec.structs.replace(p, mean_input_tokens_sq=0.0, mean_input_output_tokens=0.0) for p in series(2000, 30, 4.0)]
    legacy = mix_of(old, 60.0)
    assert legacy is not None and legacy.isl_sq == pytest.approx(4e6) and legacy.isl_osl == pytest.approx(60000)
    assert mix_of([], 60.0) is None


def test_moves_one_flip_at_a_time_after_confirmation_towards_the_best_split() -> None:
    pools = PoisePools(MODEL, CTX, split_params())
    code = series(2048, 28, 20.0)
    assert pools.decide(snap(cluster(4, 4), code), 0.0) is None  # first evaluation: not yet confirmed
    decision = pools.decide(snap(cluster(4, 4), code), 10.0)
    assert decision is not None and [c.new_role for c in decision.changes] == ["prefill"]
    # While that flip drains, nothing else moves.
    flipped = decision.changes[0].instance_id
    assert pools.decide(snap(cluster(4, 4, **{flipped: "draining"}), code), 20.0) is None
    # Inside the cooldown neither.
    assert not (pools.decide(snap(cluster(5, 3), code), 25.0) or pools.decide(snap(cluster(5, 3), code), 30.0))


def test_an_instance_that_flipped_does_not_flip_back_within_its_dwell_time() -> None:
    params = split_params(confirm=1, cooldown_s=0.0, min_dwell_s=300.0, reverse_after_s=0.0)
    pools = PoisePools(MODEL, CTX, params)
    decision = pools.decide(snap(cluster(4, 4), series(2048, 28, 20.0)), 0.0)
    assert decision is not None
    moved = decision.changes[0].instance_id
    # The mix turns decode-heavy at once: a flip back to decode is wanted. The instance that just moved is
    # idle, so it would drain soonest, but it dwells: the busier one goes.
    busy = [inst(f"p{i}", "prefill", waiting=5 + i, waiting_tokens=2_000) for i in range(1, 4)]
    after = [inst(moved, "prefill"), *busy, *[inst(f"d{i}", "decode") for i in range(4)]]
    back = pools.decide(snap(after, series(300, 1000, 40.0)), 10.0)
    assert back is not None and [c.instance_id for c in back.changes] == ["p1"]
    # p1's flip went through; past its dwell time the first instance may move again.
    done = [inst(moved, "prefill"), *busy[1:], inst("p9", "prefill", waiting=9, waiting_tokens=2_000),
            inst("p1", "decode"), *[inst(f"d{i}", "decode") for i in range(3)]]
    later = pools.decide(snap(done, series(300, 1000, 40.0)), 400.0)
    assert later is not None and [c.instance_id for c in later.changes] == [moved]


def test_no_reversal_within_reverse_after_and_a_called_off_flip_backs_off() -> None:
    pools = PoisePools(MODEL, CTX, split_params(confirm=1, cooldown_s=0.0, min_dwell_s=0.0))
    code, chat = series(2048, 28, 20.0), series(300, 1000, 20.0)
    first = pools.decide(snap(cluster(4, 4), code), 0.0)
    assert first is not None and first.changes[0].new_role == "prefill"
    moved = first.changes[0].instance_id
    after = [inst(moved, "prefill"), *cluster(4, 3)]
    # The mix reverses at once: a flip back waits reverse_after_s.
    assert pools.decide(snap(after, chat), 10.0) is None
    back = pools.decide(snap(after, chat), 10.0 + pools.params.reverse_after_s)
    assert back is not None and back.changes[0].new_role == "decode"
    # That flip is called off: at the next decision the instance is ready in its old role. Decode-ward flips
    # then wait backoff_s, and twice as long after a second call-off in a row.
    seen = 10.0 + pools.params.reverse_after_s + 10.0
    assert pools.decide(snap(after, chat), seen) is None
    retry = pools.decide(snap(after, chat), seen + pools.params.backoff_s)
    assert retry is not None and retry.changes[0].new_role == "decode"
    seen2 = seen + pools.params.backoff_s + 10.0
    assert pools.decide(snap(after, chat), seen2) is None  # called off again
    assert pools.decide(snap(after, chat), seen2 + 2 * pools.params.backoff_s - 1.0) is None
    assert pools.decide(snap(after, chat), seen2 + 2 * pools.params.backoff_s) is not None


def test_no_flip_when_the_gain_is_small_but_a_queued_backlog_counts() -> None:
    pools = PoisePools(MODEL, CTX, split_params(confirm=1))
    # A balanced mix for 4P4D at a light load: the best split is within min_gain of the current one.
    loads = split_loads(MODEL, mix_of(series(1200, 200, 3.0), 120.0), 8, CTX.tpot_slo_s)  # type: ignore[arg-type]
    current = next(s for s in loads if s.prefill == 4)
    best = best_split(loads, 4)
    if not worth_a_flip(current.score, best.score, pools.params.min_gain):
        assert pools.decide(snap(cluster(4, 4), series(1200, 200, 3.0)), 0.0) is None
    # The same mix with a prefill backlog 4P4D cannot clear within the backlog horizon: more prefill is worth
    # a drain now.
    swamped = [inst(f"p{i}", "prefill", waiting=600, waiting_tokens=1_200_000) for i in range(4)] + \
        [inst(f"d{i}", "decode") for i in range(4)]
    decision = pools.decide(snap(swamped, series(1200, 200, 3.0)), 10.0)
    assert decision is not None and decision.changes[0].new_role == "prefill"


def test_past_capacity_a_flip_waits_until_the_direction_has_held_for_the_whole_window() -> None:
    # Neither split carries the load (4P4D scores 1.92, 7P1D 1.10): the direction must hold for window_s, as
    # a burst shorter than the window lifts the scores for a few evaluations.
    pools = PoisePools(MODEL, CTX, split_params())
    evaluations = math.ceil(pools.params.window_s / pools.params.interval_s)
    assert evaluations > pools.params.confirm
    overload = series(2048, 28, 80.0)
    for k in range(evaluations - 1):
        assert pools.decide(snap(cluster(4, 4), overload), 10.0 * k) is None
    decision = pools.decide(snap(cluster(4, 4), overload), 10.0 * (evaluations - 1))
    assert decision is not None and decision.changes[0].new_role == "prefill"
    # A split that carries the load (6P2D 0.96 against 4P4D's 1.44) is worth a flip after ``confirm``.
    pools = PoisePools(MODEL, CTX, split_params())
    assert pools.decide(snap(cluster(4, 4), series(2048, 28, 60.0)), 0.0) is None
    decision = pools.decide(snap(cluster(4, 4), series(2048, 28, 60.0)), 10.0)
    assert decision is not None and decision.changes[0].new_role == "prefill"
    # A burst past capacity for two evaluations, then a decode-heavy mix that wants the other way: the burst's
    # evaluations do not count towards it, so nothing moves before it is confirmed itself.
    pools = PoisePools(MODEL, CTX, split_params())
    chat = series(300, 1000, 20.0)  # 2P6D 0.23 against 4P4D's 0.34
    for k in range(2):
        assert pools.decide(snap(cluster(4, 4), overload), 10.0 * k) is None
    assert pools.decide(snap(cluster(4, 4), chat), 20.0) is None
    decision = pools.decide(snap(cluster(4, 4), chat), 30.0)
    assert decision is not None and decision.changes[0].new_role == "decode"


def test_a_flip_is_worth_the_queueing_delay_it_removes_below_capacity() -> None:
    gain = PoiseParams().min_gain
    assert gain == 0.25
    assert worth_a_flip(0.81, 0.65, gain)  # a ratio of 0.80, but the wait load / (1 - load) falls by 56%
    assert not worth_a_flip(0.30, 0.25, gain)  # the wait falls by 22%
    assert worth_a_flip(0.40, 0.28, gain)  # by 42%
    assert worth_a_flip(1.05, 0.98, gain)  # past capacity: a split that carries the load
    assert worth_a_flip(1.50, 1.10, gain) and not worth_a_flip(1.50, 1.20, gain)  # neither carries it: the ratio
    assert not worth_a_flip(0.90, 0.90, gain) and not worth_a_flip(1.20, 1.20, gain)


def test_the_same_better_split_is_worth_a_drain_near_capacity_and_not_at_a_light_load() -> None:
    # A prefill-leaning mix on 4P4D: 5P3D scores 0.8 of 4P4D at every rate (both loads are linear in it), a
    # smaller gain than min_gain as a ratio. Near capacity it removes most of the queueing delay and is worth
    # a drain, before 4P4D is past capacity; at a light load it is not. Past capacity it always is.
    def scores(rate: float) -> tuple[float, float]:
        loads = split_loads(MODEL, mix_of(series(2000, 300, rate), 120.0), 8, CTX.tpot_slo_s,  # type: ignore[arg-type]
                            ttft_slo_s=CTX.ttft_slo_s)
        best = best_split(loads, 4)
        assert best.prefill == 5
        return next(x for x in loads if x.prefill == 4).score, best.score

    def flips(rate: float) -> bool:
        pools = PoisePools(MODEL, CTX, split_params())
        assert pools.decide(snap(cluster(4, 4), series(2000, 300, rate)), 0.0) is None  # not confirmed yet
        decision = pools.decide(snap(cluster(4, 4), series(2000, 300, rate)), 10.0)
        assert decision is None or decision.changes[0].new_role == "prefill"
        return decision is not None

    gain = PoiseParams().min_gain
    light = next(r / 10 for r in range(10, 2000) if scores(r / 10)[0] > 0.15)
    near = next(r / 10 for r in range(10, 2000) if scores(r / 10)[0] > 0.8)
    over = next(r / 10 for r in range(10, 2000) if scores(r / 10)[0] > 1.0)
    for rate in (light, near, over):
        current, best = scores(rate)
        assert best == pytest.approx(0.8 * current) and best >= current * (1 - gain)
    assert not flips(light)
    assert scores(near)[0] <= 1.0 and flips(near)
    assert flips(over)


def test_decode_kv_keeps_headroom_for_large_requests_not_small_ones() -> None:
    # The same mean KV in use, as a few long prompts or many short ones: the pool of few large requests
    # overflows more often, so its bound keeps more headroom (one standard deviation of a compound Poisson).
    long, short = equal_lengths(2.0, 12000, 300), equal_lengths(20.0, 1200, 30)
    mean = 200_000.0
    assert kv_tokens_bound(long, mean) - mean > 3 * (kv_tokens_bound(short, mean) - mean) > 0.0
    assert kv_tokens_bound(long, mean, kv_sd=0.0) == mean
    # Where KV binds (a loaded decode side with long prompts), the bound is what decode_rho reports.
    loaded = equal_lengths(4.0, 12000, 300)
    assert decode_rho(MODEL, loaded, 1, 1.0) > 1.1 * decode_rho(MODEL, loaded, 1, 1.0, kv_sd=0.0)
    # The controller's kv_sd reaches every decode score: the splits' and colocated serving's.
    splits = {sd: split_loads(MODEL, loaded, 8, 1.0, kv_sd=sd) for sd in (0.0, 1.0)}
    assert splits[1.0] == split_loads(MODEL, loaded, 8, 1.0)
    assert all(a.rho_decode >= b.rho_decode for a, b in zip(splits[1.0], splits[0.0], strict=True))
    assert splits[1.0][-1].decode == 1 and splits[1.0][-1].rho_decode > 1.1 * splits[0.0][-1].rho_decode
    assert colocated_load(MODEL, loaded, 3, 1.0).rho > 1.1 * colocated_load(MODEL, loaded, 3, 1.0, kv_sd=0.0).rho


def test_past_capacity_a_decode_step_costs_at_most_a_full_pool_and_requests_wait_for_kv() -> None:
    # 12K-token prompts, 300-token answers, 6 req/s on one decode instance with a 0.1-s TPOT SLO: the arrivals
    # want more decode compute than it has, but its steps cannot grow past one over its whole KV pool and every
    # running slot (about 32 ms here, not the SLO's 100 ms): requests wait for KV instead, which the KV bound
    # prices at that step.
    p = MODEL.profile
    mix = equal_lengths(6.0, 12000, 300)
    full = p.decode_overhead_s + p.decode_s_per_seq * p.max_running_requests + p.decode_s_per_context_token * p.kv_capacity_tokens
    kv = 6.0 * (prefill_kv_seconds(MODEL, mix, 0.0) + full * (12000 + 300) * 300) / p.kv_capacity_tokens
    assert full < 0.05
    assert decode_rho(MODEL, mix, 1, 0.1, kv_sd=0.0) == pytest.approx(kv)
    # A step that prefills a prompt too (DOPD's local prefill, colocated serving) may cost that prompt's work
    # more: colocated engines carry a chunk of SGLang's size.
    local = msgspec.structs.replace(mix, local_share=0.5, local_isl=400.0)
    assert decode_rho(MODEL, local, 1, 0.1, kv_sd=0.0, step_prompt_tokens=8192) > decode_rho(MODEL, local, 1, 0.1, kv_sd=0.0)
    # Below capacity the step is the load's own, under the cap: the cap changes nothing there.
    light = equal_lengths(0.5, 12000, 300)
    assert decode_rho(MODEL, light, 1, 0.1) == decode_rho(MODEL, light, 1, 0.1, step_prompt_tokens=8192)


def test_a_drain_past_its_deadline_is_called_off() -> None:
    queue = EventQueue()
    sim = SimCluster(["prefill", "prefill", "decode"], MODEL, LeastLoad(), queue, costs=SimCosts(drain_timeout_s=5.0))
    for k in range(400):  # 400 prompts of 8K: minutes of prefill work
        req = SimRequest(index=k, rid=f"r{k}", arrival_s=0.0, input_tokens=8000, output_tokens=2, slo_ttft_s=2.0,
                         slo_tpot_s=0.15)
        queue.at(0.0, PRIORITY_ARRIVAL, lambda req=req: sim.submit(req))  # type: ignore[misc]
    p0 = sim.instances["p0"]
    queue.at(1.0, PRIORITY_ARRIVAL, lambda: sim.flip(p0, "decode"))
    queue.run()
    assert sim.lifecycle.flips_called_off == 1 and sim.lifecycle.flips == 0
    assert p0.role == "prefill" and p0.status == "ready"
    assert len(sim.finished) == 400  # nothing lost
    assert any("flip called off" in what for _, _, what in sim.lifecycle.events)


def test_max_flips_in_window_counts_per_instance() -> None:
    events = [[0.0, "p0", "drain to flip to decode"], [100.0, "p0", "drain to flip to prefill"],
              [350.0, "p0", "drain to flip to decode"], [10.0, "d1", "drain to flip to prefill"], [5.0, "p0", "ready"]]
    assert max_flips_in_window(events, 300.0) == 2  # type: ignore[arg-type]
    assert max_flips_in_window(events, 50.0) == 1  # type: ignore[arg-type]


def test_on_a_shifting_stress_slice_poise_holds_without_oscillating() -> None:
    # Held-out stress workload: short prompts turning into long ones over ten minutes. The fixed 4P4D split
    # it starts from holds >= 90% at this load; poise must not do worse, and must not ping-pong.
    w = load_trace("stress-mix-shift").slice(480.0, 720.0)
    slo = slo_for("stress-mix-shift")
    yardstick = Yardstick(warmup_s=60.0)
    static = curve_point(w, make_mix("static-minload", 8, "4P4D"), MODEL, slo, 3.0, yardstick=yardstick)
    run = simulate(w, make_mix("poise", 8, "4P4D"), MODEL, slo, rate_scale=3.0, rate_mode="natural",
                   warmup_s=yardstick.warmup_s)
    lifecycle = run.config["lifecycle"]
    assert static.attainment >= 0.9
    assert run.summary.slo_attainment >= static.attainment - 0.005
    assert max_flips_in_window(lifecycle["events"], 300.0) <= 1
    assert lifecycle["flips_called_off"] == 0
    # While the prompts are short it moves the cluster into colocated serving, in rounds of restarts, and
    # stays there while the TPOT it serves at holds as the prompts grow. No ping-pong: one mode change each
    # way at most.
    targets = [what.rsplit(" ", 1)[-1] for _, _, what in lifecycle["events"] if what.startswith("drain to flip")]
    modes = ["colocated" if t == "null" else "disaggregated" for t in targets]
    changes = sum(a != b for a, b in zip(modes, modes[1:], strict=False))
    assert 1 <= len(targets) <= 12 and changes <= 1 and modes[0] == "colocated", targets


def test_colocated_serving_is_feasible_only_while_a_typical_prompt_fits_a_step() -> None:
    chat = Mix(rate_rps=20.0, isl=1155, osl=211, isl_sq=1601.0**2, osl_sq=2 * 211.0**2, isl_osl=1155 * 211)
    code = Mix(rate_rps=20.0, isl=2048, osl=28, isl_sq=2844.0**2, osl_sq=2 * 28.0**2, isl_osl=2048 * 28)
    co_chat = colocated_load(MODEL, chat, 8, 0.15)
    co_code = colocated_load(MODEL, code, 8, 0.1)
    assert co_chat.feasible and not co_code.feasible and co_code.score == float("inf")
    assert co_chat.step_s == pytest.approx(MODEL.profile.decode_overhead_s + MODEL.prefill_work_s(1601))
    # Eight engines doing both phases carry a chat mix with less load than the best split of eight.
    assert co_chat.score < best_split(split_loads(MODEL, chat, 8, 0.15, ttft_slo_s=2.0)).score
    # The load is the decode model's with every prompt prefilled in the decode steps.
    everything_local = msgspec.structs.replace(chat, local_share=1.0, local_isl=chat.isl)
    assert co_chat.rho == pytest.approx(decode_rho(MODEL, everything_local, 8, 0.15))


def colocated(n: int) -> list[InstanceLoad]:
    return [inst(f"c{i}", "null") for i in range(n)]


def test_poise_moves_the_cluster_into_colocated_serving_in_rounds_the_load_can_spare_and_out_when_prompts_grow() -> None:
    pools = PoisePools(MODEL, CTX, PoiseParams(min_dwell_s=0.0))
    chat = series(1155, 211, 20.0)
    assert pools.decide(snap(cluster(4, 4), chat), 0.0) is None  # not yet confirmed
    first = pools.decide(snap(cluster(4, 4), chat), 10.0)
    # A light load fits on four instances in either mode: half the cluster restarts at once, from both
    # sides so that the pairs left keep serving.
    assert first is not None and [c.new_role for c in first.changes] == ["null"] * 4 and pools.mode == "colocated"
    moved = {c.instance_id for c in first.changes}
    rest = [i for i in cluster(4, 4) if i.info.instance_id not in moved]
    assert {i.info.role for i in rest} == {"prefill", "decode"}
    # Nothing else moves while those restarts are under way ...
    assert pools.decide(snap(cluster(4, 4, **dict.fromkeys(moved, "switching")), chat), 20.0) is None
    # ... and the next round goes as soon as they are done: no cooldown inside a mode change.
    second = pools.decide(snap([*rest, *colocated(4)], chat), 21.0)
    assert second is not None and [c.new_role for c in second.changes] == ["null"] * 4
    # Long prompts: a colocated step would break the TPOT SLO. The mode is left without waiting out its
    # dwell (after confirmation), a decode instance first so that the first prefill one has a partner; half
    # the cluster a round, as engines that miss their TPOT serve little in time while they wait their turn.
    code = series(6000, 28, 5.0)
    assert pools.decide(snap(colocated(8), code), 40.0) is None
    back = pools.decide(snap(colocated(8), code), 50.0)
    assert back is not None and pools.mode == "disaggregated"
    roles = [c.new_role for c in back.changes]
    assert len(roles) == 4 and roles[:2] == ["decode", "prefill"]
    left = [c.instance_id for c in back.changes]
    rest = [i for i in colocated(8) if i.info.instance_id not in left]
    split = [inst(f"x{k}", role) for k, role in enumerate(roles)]
    nxt = pools.decide(snap([*split, *rest], code), 60.0)
    assert nxt is not None and len(nxt.changes) == 4 and {c.new_role for c in nxt.changes} <= {"prefill", "decode"}


def test_a_colocated_mode_that_fails_its_step_is_left_under_an_overload_too() -> None:
    """Past every split's capacity a colocated cluster is kept (restarts would only take capacity away) unless
    it fails where the step rule says it must: then a split, which sheds what it cannot serve in time, is the
    better of two overloads."""
    code = series(6000, 28, 60.0)  # long prompts at a rate no split of 8 carries
    mix = mix_of(code, 120.0)
    assert mix is not None
    pools = PoisePools(MODEL, CTX, PoiseParams(min_dwell_s=0.0))
    assert pools.scores_away(mix, 8, 1)[0] > 1.0
    pools.decide(snap(colocated(8), code), 0.0)
    out = pools.decide(snap(colocated(8), code), 10.0)
    assert pools.last_colocated is not None and not pools.last_colocated.feasible
    assert out is not None and pools.mode == "disaggregated" and len(out.changes) == 4
    # A colocated mode whose step fits stays put under the same overload (the model alone, nothing measured).
    chat = series(1155, 211, 200.0)
    chat_mix = mix_of(chat, 120.0)
    assert chat_mix is not None and pools.scores_away(chat_mix, 8, 1)[0] > 1.0
    stay = PoisePools(MODEL, CTX, PoiseParams(min_dwell_s=0.0))
    for t in (0.0, 10.0, 20.0):
        assert stay.decide(snap(colocated(8), chat), t) is None
    assert stay.mode == "colocated"


def test_a_colocated_mode_failing_where_its_load_fits_is_left_under_an_overload_too() -> None:
    """Steps that miss while the colocated load fits the decode target fail for the prompts, not the load
    (the tail of a mix moving to longer prompts grows before its typical step breaks the step rule): no load
    shed mends that, so the cluster leaves although no split carries the load. Where the colocated load is
    past the target too, the overload explains the miss and the cluster stays."""

    def measured(rate: float) -> list[SeriesPoint]:
        return [msgspec.structs.replace(p, tpot_p90_s=0.8 * CTX.tpot_slo_s) for p in series(1200, 90, rate)]

    fits = PoisePools(MODEL, CTX, PoiseParams(min_dwell_s=0.0))
    fits.mode = "colocated"
    mix = mix_of(measured(130.0), 120.0)
    assert mix is not None and fits.scores_away(mix, 8, 1)[0] > 1.0
    assert fits.decide(snap(colocated(8), measured(130.0)), 0.0) is None
    out = fits.decide(snap(colocated(8), measured(130.0)), 10.0)
    co = fits.last_colocated
    assert co is not None and co.feasible and co.rho <= fits.params.decode_target
    assert out is not None and fits.mode == "disaggregated" and len(out.changes) == 4
    overloaded = PoisePools(MODEL, CTX, PoiseParams(min_dwell_s=0.0))
    overloaded.mode = "colocated"
    for t in (0.0, 10.0, 20.0):
        assert overloaded.decide(snap(colocated(8), measured(200.0)), t) is None
    co = overloaded.last_colocated
    assert co is not None and co.feasible and co.rho > overloaded.params.decode_target
    assert overloaded.mode == "colocated"


def test_a_mode_change_under_load_restarts_one_instance_at_a_time() -> None:
    # The highest chat rate at which both modes still carry the load with one instance away: two away would
    # not fit, so each round restarts one instance.
    pools = PoisePools(MODEL, CTX, PoiseParams(min_dwell_s=0.0))
    rate = 20.0
    while True:
        mix = mix_of(series(1155, 211, rate + 1.0), 120.0)
        assert mix is not None
        if max(pools.scores_away(mix, 8, 1)) > 1.0:
            break
        rate += 1.0
    mix = mix_of(series(1155, 211, rate), 120.0)
    assert mix is not None and max(pools.scores_away(mix, 8, 2)) > 1.0, "no rate where one away fits and two do not"
    chat = series(1155, 211, rate)
    pools.decide(snap(cluster(4, 4), chat), 0.0)
    first = pools.decide(snap(cluster(4, 4), chat), 10.0)
    assert first is not None and pools.mode == "colocated" and len(first.changes) == 1


def test_after_leaving_colocated_serving_the_way_back_waits_out_the_mode_dwell() -> None:
    pools = PoisePools(MODEL, CTX, PoiseParams(min_dwell_s=0.0, mode_dwell_s=900.0))
    pools.decide(snap(colocated(8), series(6000, 28, 5.0)), 0.0)
    left = pools.decide(snap(colocated(8), series(6000, 28, 5.0)), 10.0)
    assert left is not None and pools.mode == "disaggregated"
    # The prompts are short again at once: colocated serving scores better, but the mode just changed.
    chat = series(1155, 211, 20.0)
    for t in (20.0, 30.0, 500.0, 900.0):
        decision = pools.decide(snap(cluster(4, 4), chat), t)
        assert pools.mode == "disaggregated" and (decision is None or "null" not in [c.new_role for c in decision.changes])
    back = pools.decide(snap(cluster(4, 4), chat), 910.0)
    assert pools.mode == "colocated" and back is not None and back.changes[0].new_role == "null"


def test_colocated_engines_take_their_share_beside_pairs_and_everything_alone() -> None:
    engines = [EngineView(instance_id=i, role=r, status="ready", kv_capacity_tokens=380_000,  # type: ignore[arg-type]
                          max_running_requests=256)
               for i, r in [("p0", "prefill"), ("p1", "prefill"), ("d0", "decode"), ("d1", "decode"),
                            ("d2", "decode"), ("d3", "decode"), ("c0", "null"), ("c1", "null")]]
    for policy in (LeastLoad(), ArrowDispatch(MODEL, CTX)):
        picks = [policy.place(RequestView(rid=f"r{k}", input_tokens=100, max_output_tokens=10), engines, 0.0)
                 for k in range(400)]
        alone = [p for p in picks if isinstance(p, Placement) and p.prefill_id is None]
        assert len(alone) == 100  # 2 of 8 instances: a quarter of the requests
        assert {p.decode_id for p in alone} == {"c0"}  # equal queues: the lowest id (views do not change here)
        only = policy.place(RequestView(rid="x", input_tokens=100, max_output_tokens=10), engines[6:], 0.0)
        assert isinstance(only, Placement) and only.prefill_id is None


def test_colocated_serving_is_not_entered_under_a_load_that_one_instance_away_would_break() -> None:
    chat = series(1155, 211, 20.0)
    light = PoisePools(MODEL, CTX)
    light.decide(snap(cluster(4, 4), chat), 0.0)
    assert light.decide(snap(cluster(4, 4), chat), 10.0) is not None and light.mode == "colocated"
    # The same mix at a rate where seven instances would be past capacity in either mode: no move begins
    # (each would take an instance away for its drain and restart while the queues grow).
    mix = mix_of(chat, 120.0)
    assert mix is not None
    heavy_rate = 20.0 / colocated_load(MODEL, mix, 7, CTX.tpot_slo_s).score * 1.05
    heavy = series(1155, 211, heavy_rate)
    pools = PoisePools(MODEL, CTX)
    for t in (0.0, 10.0, 20.0):
        decision = pools.decide(snap(cluster(4, 4), heavy), t)
        assert pools.mode == "disaggregated" and (decision is None or "null" not in [c.new_role for c in decision.changes])


def test_colocated_serving_is_left_when_the_tpot_it_serves_at_nears_the_slo() -> None:
    pools = PoisePools(MODEL, CTX, PoiseParams(min_dwell_s=0.0))
    pools.mode = "colocated"

    def measured(tpot_p90_s: float) -> list[SeriesPoint]:
        # Long prompts the model calls infeasible for colocated steps, and a measured TPOT p90.
        return [msgspec.structs.replace(p, tpot_p90_s=tpot_p90_s) for p in series(3500, 100, 10.0)]

    assert window_tpot_p90(measured(0.05), 60.0) == pytest.approx(0.05)
    # The model alone would leave; the measurement says colocated serving holds: it stays.
    for t in (0.0, 10.0, 20.0):
        assert pools.decide(snap(colocated(8), measured(0.05)), t) is None and pools.mode == "colocated"
    # Measured at 80% of the SLO: it leaves (after confirmation), a decode instance first.
    high = measured(0.8 * CTX.tpot_slo_s)
    assert pools.decide(snap(colocated(8), high), 30.0) is None
    back = pools.decide(snap(colocated(8), high), 40.0)
    assert pools.mode == "disaggregated" and back is not None and back.changes[0].new_role == "decode"


def ranks_split_above_colocated(pools: PoisePools) -> bool:
    """Whether the last evaluation scored the best split ``mode_gain`` below colocated serving's load."""
    assert pools.last_loads is not None and pools.last_colocated is not None
    best = min(s.score for s in pools.last_loads)
    keep = 1.0 - pools.params.mode_gain
    return best < pools.last_colocated.rho / pools.params.decode_target * keep


def test_colocated_serving_is_not_left_for_a_better_scored_split_that_would_not_carry_the_load_either() -> None:
    # Chat at an overload: the model scores the best split below colocated serving's load (on chat it does so
    # only past capacity), yet no split carries it with an instance away. Restarting one would only take
    # capacity away.
    overload = series(1048, 208, 147.0)
    mix = mix_of(overload, 120.0)
    assert mix is not None
    pools = PoisePools(MODEL, CTX, PoiseParams(min_dwell_s=0.0))
    pools.mode = "colocated"
    assert pools.scores_away(mix, 8, 1)[0] > 1.0
    for t in (0.0, 10.0, 20.0, 30.0):
        assert pools.decide(snap(colocated(8), overload), t) is None and pools.mode == "colocated"
        assert ranks_split_above_colocated(pools)


def busy_decode(i: str, used_tokens: int, running: int = 100) -> InstanceLoad:
    info = InstanceInfo(instance_id=i, role="decode", status="ready", engine_kind="sim", url="sim://x",
                        bootstrap_host="", bootstrap_port=None, model="m", profile="p", kv_capacity_tokens=380_000,
                        max_running_requests=256, sidecar="sim", registered_at_unix_s=0.0)
    load = LoadReport(instance_id=i, role="decode", status="ready", ts_unix_s=0.0, num_running_reqs=running,
                      num_used_tokens=used_tokens, num_running_tokens=used_tokens, max_total_num_tokens=380_000)
    return InstanceLoad(info=info, load=load, load_age_s=0.0)


@pytest.mark.parametrize(("drain_migration", "used_tokens", "flips"), [
    (None, 150_000, False),  # waiting for 100 answers of a heavy-tailed mix: over a minute, deferred
    ("recompute", 150_000, True),  # moved to the other three decode instances, which have room: about a second
    ("recompute", 300_000, False),  # the others' free KV (3 x 80K) cannot take its 300K tokens: it would wait
])
def test_a_decode_instance_that_drains_by_migration_may_flip_where_waiting_for_its_answers_may_not(
        drain_migration: str | None, used_tokens: int, flips: bool) -> None:
    ctx = msgspec.structs.replace(CTX, drain_migration=drain_migration)
    pools = PoisePools(MODEL, ctx, split_params(confirm=1))
    # Prompts of 4K at 8 req/s want 5P3D; answers average 200 tokens with a long tail (E[OSL^2] = 40 OSL^2).
    points = [msgspec.structs.replace(p, mean_output_tokens_sq=40 * 200.0**2) for p in series(4000, 200, 8.0)]
    instances = [inst(f"p{i}", "prefill") for i in range(4)] + [busy_decode(f"d{i}", used_tokens) for i in range(4)]
    decision = pools.decide(snap(instances, points), 0.0)
    report = pools.report()  # what the planner publishes and shows
    assert decision is not None and best_split(list(report.splits)).prefill == 5 == report.target_prefill
    assert bool(decision.changes) is flips
    assert report.drains_deferred == (0 if flips else 1) and "best 5P3D" in report.reason
    if flips:
        assert decision.changes[0].new_role == "prefill"
