"""DOPD's ratio model, its scaling and flip policies, and Poise's arbitration of DOPD and Arrow."""

from __future__ import annotations

import math

import msgspec
import pytest

from loadgen.sim.baselines import make_mix
from loadgen.sim.run import simulate
from loadgen.slo import slo_for
from loadgen.traces import load_trace
from shared.latency import LatencyModel, load_profile
from shared.policies import (
    DopdParams,
    DopdPools,
    DopdScaling,
    PolicyContext,
    optimal_split,
    split_of,
)
from shared.protocol import ClusterSnapshot, InstanceInfo, InstanceLoad, LoadReport, SeriesPoint

MODEL = LatencyModel(load_profile())
CTX = PolicyContext(ttft_slo_s=3.0, tpot_slo_s=0.1, max_instances=8)


def test_the_ratio_follows_eq_14_on_the_profile() -> None:
    s = optimal_split(MODEL, CTX, isl=2048, osl=28, concurrency=100, rate_rps=40.0)
    p = MODEL.profile
    assert s.n_max == min(p.max_running_requests, p.kv_capacity_tokens // (2048 + 28))
    assert s.n_d == int(0.9 * s.n_max)
    assert s.t_prefill_s == pytest.approx(MODEL.prefill_time_s(2048))
    assert s.t_decode_s == pytest.approx(MODEL.decode_step_time_s(s.n_d, int(s.n_d * (2048 + 14))))
    assert s.ratio == pytest.approx(s.n_d * s.t_prefill_s / (28 * s.t_decode_s))
    assert s.decode == math.ceil(100 / s.n_d)
    # The spec's R* x N_D, or enough prefill for the arrival rate at 80% utilisation, whichever is more.
    assert s.prefill == max(math.ceil(s.ratio * s.decode), math.ceil(40.0 * s.t_prefill_s / 0.8))
    # Conversation-like lengths at a high rate: R* x N_D (= 2) would leave prefill short; the rate term wins.
    busy = optimal_split(MODEL, CTX, isl=1155, osl=211, concurrency=100, rate_rps=80.0)
    assert busy.decode == 1 and math.ceil(busy.ratio) == 2
    assert busy.prefill == math.ceil(80.0 * busy.t_prefill_s / 0.8) > 2
    # Long prompts and short outputs (Azure code) want far more prefill than conversations do.
    conv = optimal_split(MODEL, CTX, isl=1155, osl=211, concurrency=100)
    assert s.ratio > 5 * conv.ratio and 1.0 < conv.ratio < 3.0


def test_prompts_prefilled_on_decode_are_priced_on_decode() -> None:
    conv = PolicyContext(ttft_slo_s=2.0, tpot_slo_s=0.15, max_instances=8)
    spec = optimal_split(MODEL, conv, isl=1160, osl=260, concurrency=560, rate_rps=100.0)
    assert (spec.local_share, spec.t_local_s) == (0.0, 0.0)
    assert optimal_split(MODEL, conv, 1160, 260, 560, 100.0, local_share=0.0, local_isl=300) == spec
    # Azure conversation's lengths with 29% of the prompts (mean 290 tokens) prefilled on their decode instance:
    # the prefill instances get only the rest, longer on average, and the decode instances the local work.
    local = optimal_split(MODEL, conv, isl=1160, osl=260, concurrency=560, rate_rps=100.0, local_share=0.29,
                          local_isl=290)
    remote_isl = (1160 - 0.29 * 290) / 0.71
    assert local.t_prefill_s == pytest.approx(MODEL.prefill_time_s(int(remote_isl)))
    assert local.t_local_s == pytest.approx(MODEL.prefill_work_s(290))
    assert local.t_decode_s == spec.t_decode_s
    assert local.ratio == pytest.approx(local.n_d * 0.71 * local.t_prefill_s
                                        / (260 * local.t_decode_s + local.n_d * 0.29 * local.t_local_s))
    assert local.prefill == max(math.ceil(local.ratio * local.decode),
                                math.ceil(100.0 * 0.71 * local.t_prefill_s / 0.8))
    # Eq. 14 alone asks for 5P3D; priced where the work runs, 4P4D (what holds the most goodput there).
    assert split_of(8, spec.ratio)[0] == 5 and split_of(8, local.ratio)[0] == 4
    # Everything local: no prefill work at all.
    assert optimal_split(MODEL, conv, 300, 260, 560, 100.0, local_share=1.0, local_isl=300).ratio == 0.0


def test_dopd_pools_reads_the_local_share_from_the_series() -> None:
    conv = PolicyContext(ttft_slo_s=2.0, tpot_slo_s=0.15, max_instances=8)
    cluster = [inst(f"p{i}", "prefill") for i in range(4)] + [inst(f"d{i}", "decode") for i in range(4)]
    targets = {}
    for local in (0, 6):  # of 20 completed requests per 5 s point
        points = [msgspec.structs.replace(p, local_prefilled=local, mean_local_input_tokens=290.0 if local else 0.0)
                  for p in series(2, 1160, 260, 560)]
        policy = DopdPools(MODEL, conv)
        policy.update_target(snap(cluster, points))
        assert policy.last_split is not None and policy.last_split.local_share == pytest.approx(local / 20)
        targets[local] = policy.target_prefill
    assert targets == {0: 5, 6: 4}


def test_a_fixed_gpu_count_is_split_by_the_ratio_with_a_dead_band() -> None:
    assert split_of(8, 16.7) == (7, 1)  # never below one decode
    assert split_of(8, 1.86) == (5, 3)
    assert split_of(8, 0.01) == (1, 7)
    # 8 * 1.4 / 2.4 = 4.67: rounds to 5, but from 4 the dead band keeps 4 ...
    assert split_of(8, 1.4) == (5, 3)
    assert split_of(8, 1.4, current=4, dead_band=0.25) == (4, 4)
    # ... until the share is clearly closer to 5 than the band allows.
    assert split_of(8, 2.0, current=4, dead_band=0.25) == (5, 3)


def inst(i: str, role: str, *, status: str = "ready", waiting: int = 0, kv: float = 0.0,
         bootstrap: int = 0) -> InstanceLoad:
    info = InstanceInfo(instance_id=i, role=role, status=status, engine_kind="sim", url="sim://x",  # type: ignore[arg-type]
                        bootstrap_host="", bootstrap_port=None, model="m", profile="p", kv_capacity_tokens=380_000,
                        max_running_requests=256, sidecar="sim", registered_at_unix_s=0.0)
    load = LoadReport(instance_id=i, role=role, status=status, ts_unix_s=0.0,  # type: ignore[arg-type]
                      num_waiting_reqs=waiting, token_usage=kv, num_used_tokens=int(kv * 380_000),
                      prefill_queue_reqs=bootstrap, prefill_bootstrap_reqs=bootstrap)
    return InstanceLoad(info=info, load=load, load_age_s=0.0)


def series(n: int, isl: float, osl: float, running: float, start: float = 0.0) -> list[SeriesPoint]:
    return [SeriesPoint(start_unix_s=start + 5 * k, interval_s=5.0, arrivals=20, arrival_rate_rps=4.0, completed=20,
                        mean_input_tokens=isl, mean_output_tokens=osl, mean_running_reqs=running, ttft_p90_s=None,
                        tpot_p90_s=None) for k in range(n)]


def snap(instances: list[InstanceLoad], points: list[SeriesPoint]) -> ClusterSnapshot:
    return ClusterSnapshot(ts_unix_s=0.0, instances=instances, series=points)


def test_dopd_scaling_sizes_roles_from_the_forecast_within_the_step_limit() -> None:
    policy = DopdScaling(MODEL, CTX)
    cluster = [inst("p0", "prefill"), inst("d0", "decode")]
    want = optimal_split(MODEL, CTX, 2048, 28, 400.0)
    assert want.prefill > 3  # far more than one prefill instance
    target = None
    for k in range(8):  # steady series: the forecast converges on it
        target = policy.decide(snap(cluster, series(2 * (k + 1), 2048, 28, 400.0)), now_s=10.0 * k) or target
    assert target is not None and target.prefill == 3 and target.decode >= 1  # 1 + max_step 2 in one decision
    report = policy.report()  # what the planner publishes and shows
    assert report.forecast is not None and report.forecast.prefill == want.prefill and report.target_prefill is None
    assert report.forecast_decisions >= len(report.forecast_recent_s) > 0 and max(report.forecast_recent_s) < 5.0
    assert report.reason.startswith(f"forecast ISL {report.forecast.isl:.0f}")


def test_dopd_burst_fast_path_adds_prefill_without_waiting_for_the_interval() -> None:
    policy = DopdScaling(MODEL, CTX, DopdParams(interval_s=600))
    policy.decide(snap([inst("p0", "prefill"), inst("d0", "decode")], series(2, 1000, 100, 5)), 0.0)
    burst = [inst("p0", "prefill", waiting=30), inst("p1", "prefill", waiting=30), inst("d0", "decode")]
    target = policy.decide(snap(burst, series(3, 1000, 100, 5)), 1.0)
    assert target is not None and target.prefill == 4 and "burst" in target.reason  # +2, the step limit
    full_kv = [inst("p0", "prefill"), inst("d0", "decode", kv=0.97), inst("d1", "decode", kv=0.99)]
    target = policy.decide(snap(full_kv, series(4, 1000, 100, 5)), 2.0)
    assert target is not None and target.decode == 3


def test_dopd_burst_fast_path_does_not_read_prompts_blocked_on_decode_kv_as_a_prefill_burst() -> None:
    # SGLang counts a prefill engine's bootstrap queue (prompts whose decode side has no KV for them yet) in
    # num_waiting_reqs: 30 such prompts per prefill engine are a decode shortage, not a prefill burst.
    policy = DopdScaling(MODEL, CTX, DopdParams(interval_s=600))
    policy.decide(snap([inst("p0", "prefill"), inst("d0", "decode")], series(2, 1000, 100, 5)), 0.0)
    blocked = [inst("p0", "prefill", waiting=30, bootstrap=30), inst("p1", "prefill", waiting=30, bootstrap=30),
               inst("d0", "decode", kv=0.5)]
    assert policy.decide(snap(blocked, series(3, 1000, 100, 5)), 1.0) is None
    computing = [inst("p0", "prefill", waiting=31, bootstrap=1), inst("p1", "prefill", waiting=30),
                 inst("d0", "decode", kv=0.5)]
    target = policy.decide(snap(computing, series(4, 1000, 100, 5)), 2.0)
    assert target is not None and target.prefill == 4 and "burst" in target.reason


def _periodic_decode(policy: DopdScaling, cluster: list[InstanceLoad], times: range) -> dict[int, int]:
    """Decode counts the periodic decisions at ``times`` ask for (light load: the forecast wants 4P1D)."""
    out = {}
    for t in times:
        target = policy.decide(snap(cluster, series(t // 5 + 2, 1000, 100, 5)), float(t))
        if target is not None:
            out[t] = target.decode
    return out


def test_dopd_scale_in_waits_for_the_fast_paths_replicas_to_start_and_serve() -> None:
    assert optimal_split(MODEL, CTX, 1000, 100, 5.0, 4.0).decode == 1
    policy = DopdScaling(MODEL, CTX)  # 10-s interval, scale in after 6 lower results
    prefills = [inst(f"p{i}", "prefill") for i in range(4)]
    # Light load on 4 decode instances: six lower forecasts in a row, then a step down.
    assert _periodic_decode(policy, [*prefills, *(inst(f"d{i}", "decode", kv=0.3) for i in range(4))],
                            range(0, 60, 10)) == {50: 2}
    # KV fills on the 2 left: the fast path adds one.
    two = [inst("d0", "decode", kv=0.97), inst("d1", "decode", kv=0.97)]
    burst = policy.decide(snap([*prefills, *two], series(12, 1000, 100, 5)), 51.0)
    assert burst is not None and burst.decode == 3 and "burst" in burst.reason
    # The forecast still says 1 decode instance, but the new one is starting (30 s here) and then serves: no
    # scale-in until it has been ready for scale_in_after intervals and six lower results follow.
    eased = [inst("d0", "decode", kv=0.3), inst("d1", "decode", kv=0.3)]
    assert _periodic_decode(policy, [*prefills, *eased, inst("d2", "decode", status="starting")],
                            range(60, 90, 10)) == {}
    ready = [*prefills, *eased, inst("d2", "decode", kv=0.3)]
    held_until = 80 + 6 * 10  # last seen starting at 80
    later = _periodic_decode(policy, ready, range(90, 260, 10))
    assert later and min(later) == held_until + 5 * 10  # the sixth lower result after the hold
    assert later[min(later)] == 1


def test_dopd_fast_path_adds_decode_for_the_kv_of_the_ready_instances_once() -> None:
    policy = DopdScaling(MODEL, CTX, DopdParams(interval_s=600))
    policy.decide(snap([inst("p0", "prefill"), inst("d0", "decode")], series(2, 1000, 100, 5)), 0.0)
    full = [inst("p0", "prefill"), inst("d0", "decode", kv=0.97), inst("d1", "decode", kv=0.97)]
    target = policy.decide(snap(full, series(2, 1000, 100, 5)), 1.0)
    assert target is not None and target.decode == 3  # 2 x 0.97 / 0.9 -> 3
    # The next second the KV is still full (the new instance is starting): 3 instances hold it, none more.
    assert policy.decide(snap([*full, inst("d2", "decode", status="starting")], series(2, 1000, 100, 5)), 2.0) is None


def test_dopd_periodic_target_keeps_the_decode_instances_the_kv_needs() -> None:
    prefills = [inst(f"p{i}", "prefill") for i in range(4)]
    # KV above the fast path's threshold on a full budget (the fast path cannot add): the forecast's 1 decode
    # instance would put the fast path straight back into action, so the periodic path removes none.
    policy = DopdScaling(MODEL, CTX)
    full = [*prefills, *(inst(f"d{i}", "decode", kv=0.95) for i in range(4))]
    assert _periodic_decode(policy, full, range(0, 200, 10)) == {}
    # KV half used: down to ceil(4 x 0.5 / 0.9) = 3, not to the forecast's 1.
    policy = DopdScaling(MODEL, CTX)
    half = [*prefills, *(inst(f"d{i}", "decode", kv=0.5) for i in range(4))]
    assert set(_periodic_decode(policy, half, range(0, 200, 10)).values()) == {3}


def test_dopd_budget_takes_no_decode_instance_the_kv_needs_for_prefill() -> None:
    # A full budget of 2P6D and a forecast that wants far more prefill: the budget gives prefill a GPU only
    # from decode instances the KV does not need.
    def periodic(kv: float) -> tuple[int, int] | None:
        policy = DopdScaling(MODEL, CTX)
        cluster = [inst("p0", "prefill"), inst("p1", "prefill"), *(inst(f"d{i}", "decode", kv=kv) for i in range(6))]
        target = policy.decide(snap(cluster, series(2, 2048, 28, 400.0)), 0.0)
        return None if target is None else (target.prefill, target.decode)

    assert periodic(kv=0.95) is None
    assert periodic(kv=0.3) == (3, 5)


def test_dopd_pools_flips_one_instance_at_a_time_towards_the_ratio() -> None:
    policy = DopdPools(MODEL, CTX)
    cluster = [inst(f"p{i}", "prefill") for i in range(4)] + [inst(f"d{i}", "decode") for i in range(4)]
    decision = policy.decide(snap(cluster, series(2, 2048, 28, 50)), 0.0)
    assert policy.target_prefill == 7
    assert decision is not None and len(decision.changes) == 1 and decision.changes[0].new_role == "prefill"
    draining = [*cluster[:7], inst("d3", "decode", status="draining")]
    assert policy.decide(snap(draining, series(3, 2048, 28, 50)), 10.0).changes == []  # type: ignore[union-attr]


def test_dopd_and_poise_reach_azure_codes_best_split_and_beat_minimal_load() -> None:
    w = load_trace("azure-code").slice(0.0, 600.0)
    slo = slo_for("azure-code")
    static = simulate(w, make_mix("static-minload", 8), MODEL, slo, rate_scale=12.0)
    ratio = simulate(w, make_mix("dopd-ratio", 8), MODEL, slo, rate_scale=12.0)
    poise = simulate(w, make_mix("poise", 8), MODEL, slo, rate_scale=12.0)
    assert ratio.config["lifecycle"]["timeline"][-1][1:] == [7, 1]  # static-best's split for this trace
    assert poise.config["lifecycle"]["timeline"][-1][1] >= 6  # prefill-heavy, as the capacity model says
    assert poise.summary.slo_attainment > static.summary.slo_attainment
    # Nothing lost: what did not finish was refused early, with a retryable 429 (a request held in the gateway
    # past its TTFT target, or one a decode backlog would make late).
    assert all(r.error is not None and r.error.startswith("429") for r in poise.records if r.status != "ok")
