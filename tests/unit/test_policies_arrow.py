"""Arrow's policies: the TTFT predictor, SLO-aware dispatch (Alg. 1-2) and the flip triggers (Alg. 3-4)."""

from __future__ import annotations

import msgspec
import pytest

from loadgen.sim.baselines import make_mix
from loadgen.sim.run import simulate
from loadgen.slo import slo_for
from loadgen.traces import load_trace
from shared.latency import LatencyModel, load_profile
from shared.policies import (
    ArrowDispatch,
    ArrowParams,
    ArrowPools,
    EngineView,
    LeastLoad,
    PolicyContext,
    RequestView,
    max_running_tokens,
)
from shared.policies.ttft_predictor import QuadraticTtft
from shared.protocol import ClusterSnapshot, InstanceInfo, InstanceLoad, LoadReport, SeriesPoint

MODEL = LatencyModel(load_profile())
CTX = PolicyContext(ttft_slo_s=3.0, tpot_slo_s=0.1, max_instances=8)


def view(i: str, role: str, **kw: object) -> EngineView:
    return EngineView(instance_id=i, role=role, status="ready", kv_capacity_tokens=380_000,  # type: ignore[arg-type]
                      max_running_requests=256, load_age_s=0.0, **kw)  # type: ignore[arg-type]


def test_the_predictor_is_the_profile_and_learns_a_slower_instance() -> None:
    q = QuadraticTtft.from_model(MODEL)
    for n in (128, 1000, 8000, 30_000):
        assert q.predict(n) == pytest.approx(MODEL.prefill_time_s(n), rel=1e-3)
    assert q.queue_delay(2, 3000, 1000**2 + 2000**2) == pytest.approx(q.predict(1000) + q.predict(2000))
    for _ in range(100):
        for n in (1000, 4000, 8000):
            q.observe(n, 1.5 * MODEL.prefill_time_s(n))
    assert q.predict(4000) == pytest.approx(1.5 * MODEL.prefill_time_s(4000), rel=0.05)  # from 1.0x to ~1.5x


def test_prefill_goes_to_the_least_predicted_delay_not_the_fewest_tokens() -> None:
    # A has one 20K prompt queued, B three 7K prompts (more tokens, but attention is quadratic).
    a = view("p0", "prefill", inflight_reqs=1, inflight_tokens=20_000, inflight_tokens_sq=20_000**2)
    b = view("p1", "prefill", inflight_reqs=3, inflight_tokens=21_000, inflight_tokens_sq=3 * 7000**2)
    d = view("d0", "decode")
    req = RequestView(rid="r", input_tokens=1000, max_output_tokens=100)
    assert LeastLoad().place(req, [a, b, d], 0.0).prefill_id == "p0"  # type: ignore[union-attr]
    assert ArrowDispatch(MODEL, CTX).place(req, [a, b, d], 0.0).prefill_id == "p1"  # type: ignore[union-attr]


def test_decode_skips_instances_over_the_tpot_slo_or_max_running_tokens() -> None:
    arrow = ArrowDispatch(MODEL, CTX)
    p = view("p0", "prefill")
    slow = view("d0", "decode", used_tokens=1000, token_interval_s=0.2)  # fewest tokens, but over 100 ms
    full = view("d1", "decode", used_tokens=arrow.max_tokens - 500)  # the request would not fit
    ok = view("d2", "decode", used_tokens=50_000, token_interval_s=0.02)
    req = RequestView(rid="r", input_tokens=1000, max_output_tokens=100)
    assert arrow.place(req, [p, slow, full, ok], 0.0).decode_id == "d2"  # type: ignore[union-attr]
    # Nobody fits: the fewest running tokens.
    assert arrow.place(req, [p, slow, full], 0.0).decode_id == "d0"  # type: ignore[union-attr]


def test_max_running_tokens_is_the_tighter_of_kv_and_the_tpot_budget() -> None:
    assert max_running_tokens(MODEL, 0.1, 0.9) == MODEL.profile.kv_capacity_tokens  # KV binds at 100 ms
    tight = max_running_tokens(MODEL, 0.02, 0.9)
    p = MODEL.profile
    assert tight < p.kv_capacity_tokens
    step = MODEL.decode_step_time_s(p.max_running_requests, tight)
    assert step == pytest.approx(0.9 * 0.02, rel=1e-3)


def inst(i: str, role: str, *, status: str = "ready", waiting: int = 0, running: int = 0, queued_tokens: int = 0,
         running_tokens: int = 0, tps: float = 0.0, kv_used: int | None = None, kv_capacity: int = 0,
         bootstrap: int = 0) -> InstanceLoad:
    info = InstanceInfo(instance_id=i, role=role, status=status, engine_kind="sim", url="sim://x",  # type: ignore[arg-type]
                        bootstrap_host="", bootstrap_port=None, model="m", profile="p", kv_capacity_tokens=380_000,
                        max_running_requests=256, sidecar="sim", registered_at_unix_s=0.0)
    load = LoadReport(instance_id=i, role=role, status=status, ts_unix_s=0.0,  # type: ignore[arg-type]
                      num_waiting_reqs=waiting, num_running_reqs=running, num_waiting_uncached_tokens=queued_tokens,
                      num_used_tokens=running_tokens if kv_used is None else kv_used, num_running_tokens=running_tokens,
                      max_total_num_tokens=kv_capacity, gen_throughput_tps=tps, prefill_queue_reqs=bootstrap,
                      prefill_bootstrap_reqs=bootstrap)
    return InstanceLoad(info=info, load=load, load_age_s=0.0)


def snap(*instances: InstanceLoad) -> ClusterSnapshot:
    point = SeriesPoint(start_unix_s=0, interval_s=5, arrivals=10, arrival_rate_rps=2, completed=10,
                        mean_input_tokens=2000, mean_output_tokens=100, mean_running_reqs=5, ttft_p90_s=None,
                        tpot_p90_s=None)
    return ClusterSnapshot(ts_unix_s=0.0, instances=list(instances), series=[point])


def test_a_sustained_tpot_breach_flips_the_least_loaded_prefill_to_decode() -> None:
    pools = ArrowPools(MODEL, CTX, ArrowParams(tpot_breach_s=2.0))
    # Decode steps take 150 ms (100 running at 666 tok/s) against a 100 ms SLO.
    cluster = (inst("p0", "prefill", waiting=3, queued_tokens=6000), inst("p1", "prefill", running=1, queued_tokens=500),
               inst("d0", "decode", running=100, running_tokens=200_000, tps=666.0))
    assert pools.decide(snap(*cluster), 10.0) is None  # breach just started
    assert pools.decide(snap(*cluster), 11.0) is None
    decision = pools.decide(snap(*cluster), 12.5)
    assert decision is not None and decision.changes[0].instance_id == "p1"
    assert decision.changes[0].new_role == "decode" and "TPOT" in decision.changes[0].reason
    # One flip at a time, and never the last prefill instance.
    assert pools.decide(snap(*cluster), 13.0) is None
    assert ArrowPools(MODEL, CTX).decide(snap(cluster[0], cluster[2]), 100.0) is None
    # Prompts waiting for decode KV (SGLang counts the bootstrap queue in num_waiting_reqs, not its tokens in
    # the uncached ones) are no prefill work: p0's 60 of them weigh less than p1's one 500-token prompt.
    blocked = (inst("p0", "prefill", waiting=60, bootstrap=60), inst("p1", "prefill", waiting=1, queued_tokens=500),
               cluster[2])
    pools = ArrowPools(MODEL, CTX, ArrowParams(tpot_breach_s=2.0))
    for t in (10.0, 12.5):
        decision = pools.decide(snap(*blocked), t)
    assert decision is not None and decision.changes[0].instance_id == "p0"


def test_prefill_pressure_flips_a_decode_only_when_decode_load_is_low() -> None:
    swamped = (inst("p0", "prefill", waiting=20, queued_tokens=200_000), inst("p1", "prefill", waiting=20, queued_tokens=200_000))
    calm_decode = (inst("d0", "decode", running=10, running_tokens=20_000, tps=800.0),
                   inst("d1", "decode", running=2, running_tokens=3000, tps=200.0))
    decision = ArrowPools(MODEL, CTX).decide(snap(*swamped, *calm_decode), 0.0)
    assert decision is not None and decision.changes[0].instance_id == "d1" and decision.changes[0].new_role == "prefill"
    # Decode busy (token interval near the SLO): decode has priority, no D→P.
    busy_decode = (inst("d0", "decode", running=100, running_tokens=150_000, tps=1100.0),
                   inst("d1", "decode", running=100, running_tokens=150_000, tps=1100.0))
    assert ArrowPools(MODEL, CTX).decide(snap(*swamped, *busy_decode), 0.0) is None
    # While an instance drains, nothing else flips.
    draining = inst("d2", "decode", status="draining")
    assert ArrowPools(MODEL, CTX).decide(snap(*swamped, *calm_decode, draining), 0.0) is None


def test_prefill_pressure_prices_the_mean_prompt_after_its_cached_prefix() -> None:
    # Idle prefill engines, 40K-token prompts: alone one takes longer than half the 3 s SLO, so Arrow asks for
    # a prefill instance. When the engines report that 90% of each prompt was a cached prefix (the monitor's
    # moments of their cached tokens), what is left to prefill takes a fraction of that, and nothing flips.
    idle = (inst("p0", "prefill"), inst("p1", "prefill"))
    calm_decode = (inst("d0", "decode", running=10, running_tokens=20_000, tps=800.0),
                   inst("d1", "decode", running=2, running_tokens=3000, tps=200.0))

    def long_prompts(cached: float) -> ClusterSnapshot:
        s = snap(*idle, *calm_decode)
        point = msgspec.structs.replace(s.series[0], mean_input_tokens=40_000, mean_cached_input_tokens=cached,
                                        mean_cached_input_tokens_sq=cached * cached)
        return msgspec.structs.replace(s, series=[point])

    q = QuadraticTtft.from_model(MODEL)
    assert q.predict(40_000) > 0.5 * CTX.ttft_slo_s > q.predict_uncached(40_000, 36_000, 36_000**2)
    decision = ArrowPools(MODEL, CTX).decide(long_prompts(0.0), 0.0)
    assert decision is not None and decision.changes[0].new_role == "prefill"
    assert ArrowPools(MODEL, CTX).decide(long_prompts(36_000.0), 0.0) is None


def test_decode_out_of_kv_is_not_low_however_small_its_running_batch() -> None:
    # Long prompts: the running batches are small, but the KV is nearly full and requests wait for memory.
    # Taking a decode instance would leave the waiting requests less memory still (ours, on top of Alg. 1).
    swamped = (inst("p0", "prefill", waiting=20, queued_tokens=200_000), inst("p1", "prefill", waiting=20, queued_tokens=200_000))

    def decodes(kv_share: float, waiting: int = 4) -> tuple[InstanceLoad, ...]:
        return tuple(inst(f"d{i}", "decode", running=3, running_tokens=20_000, tps=90.0, waiting=waiting,
                          kv_used=int(kv_share * 380_000), kv_capacity=380_000) for i in range(3))

    assert ArrowPools(MODEL, CTX).decide(snap(*swamped, *decodes(0.9)), 0.0) is None
    decision = ArrowPools(MODEL, CTX).decide(snap(*swamped, *decodes(0.3)), 0.0)  # 0.45 of two: room to spare
    assert decision is not None and decision.changes[0].new_role == "prefill"
    # Full but nobody waiting for memory (short outputs turn the KV over fast): Arrow's own check decides.
    decision = ArrowPools(MODEL, CTX).decide(snap(*swamped, *decodes(0.9, waiting=0)), 0.0)
    assert decision is not None and decision.changes[0].new_role == "prefill"
    pools = ArrowPools(MODEL, CTX)
    pools.decide(snap(*swamped, *decodes(0.9)), 7.0)
    assert pools.wanted_s["prefill"] == 7.0  # the pressure is recorded though no flip was possible


def test_with_deadline_ordered_engines_a_predicted_breach_must_also_be_observed() -> None:
    # Poise's Arrow: the FCFS prediction says every prefill misses the TTFT SLO, but D→P waits until the
    # monitor's TTFT P90 is past half the SLO too (FlowPrefill engines meet deadlines FCFS would miss).
    swamped = (inst("p0", "prefill", waiting=20, queued_tokens=200_000), inst("p1", "prefill", waiting=20, queued_tokens=200_000))
    calm_decode = (inst("d0", "decode", running=10, running_tokens=20_000, tps=800.0),
                   inst("d1", "decode", running=2, running_tokens=3000, tps=200.0))

    def observed(ttft_p90_s: float | None) -> ClusterSnapshot:
        s = snap(*swamped, *calm_decode)
        return msgspec.structs.replace(s, series=[msgspec.structs.replace(s.series[0], ttft_p90_s=ttft_p90_s)])

    params = ArrowParams(d2p_observed_frac=0.5)
    assert ArrowPools(MODEL, CTX, params).decide(observed(None), 0.0) is None
    assert ArrowPools(MODEL, CTX, params).decide(observed(0.4 * CTX.ttft_slo_s), 0.0) is None
    decision = ArrowPools(MODEL, CTX, params).decide(observed(0.6 * CTX.ttft_slo_s), 0.0)
    assert decision is not None and decision.changes[0].new_role == "prefill"
    assert ArrowPools(MODEL, CTX).decide(observed(None), 0.0) is not None  # Arrow alone acts on the prediction


def test_an_idle_prefill_joins_a_busy_decode_pool() -> None:
    pools = ArrowPools(MODEL, CTX, ArrowParams(idle_s=1.0))
    busy = inst("d0", "decode", running=200, running_tokens=370_000, tps=2500.0)
    cluster = (inst("p0", "prefill", waiting=1, queued_tokens=1000), inst("p1", "prefill"), busy)
    assert pools.decide(snap(*cluster), 0.0) is None
    decision = pools.decide(snap(*cluster), 1.5)
    assert decision is not None and decision.changes[0].instance_id == "p1" and "idles" in decision.changes[0].reason


def test_arrow_shifts_azure_code_bursts_to_prefill_and_beats_minimal_load() -> None:
    # Model-level evidence (the goodput benchmark has the full curves): at 8x Azure code, 4P4D static
    # dispatch falls to ~82% attainment; Arrow flips decode instances to prefill and gains over 5 points.
    w = load_trace("azure-code").slice(0.0, 600.0)
    slo = slo_for("azure-code")
    static = simulate(w, make_mix("static-minload", 8), MODEL, slo, rate_scale=8.0)
    arrow = simulate(w, make_mix("arrow", 8), MODEL, slo, rate_scale=8.0)
    assert arrow.config["lifecycle"]["flips"] >= 2
    assert arrow.config["lifecycle"]["timeline"][-1][1] > 4  # more prefill instances than it started with
    assert arrow.summary.slo_attainment > static.summary.slo_attainment + 0.05
    assert arrow.summary.requests_failed == 0


@pytest.mark.asyncio
async def test_the_gateway_feeds_engine_prefill_samples_to_arrows_predictor() -> None:
    from services.gateway.config import GatewaySettings
    from services.gateway.service import GatewayService
    from shared.protocol import LoadReport

    gateway = GatewayService(GatewaySettings(dispatch_policy="arrow"))
    arrow = gateway.policy
    assert isinstance(arrow, ArrowDispatch)
    before = arrow.predictor("p0").predict(4000)
    slow = [(n, 2.0 * MODEL.prefill_time_s(n)) for n in (1000, 4000, 8000)] * 40
    await gateway.on_load(LoadReport(instance_id="p0", role="prefill", status="ready", ts_unix_s=0.0,
                                     prefill_samples=slow), "subject")
    assert arrow.predictor("p0").observations == len(slow)
    assert arrow.predictor("p0").predict(4000) > 1.6 * before  # p0 runs slow: predicted slower
    assert arrow.predictor("p1").predict(4000) == pytest.approx(before)  # the others keep the profile
