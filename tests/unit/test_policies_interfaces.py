"""The pure policies behind the simulator's baselines: Dynamo's two planners, ordering, batching, length."""

from __future__ import annotations

import math

import pytest

from shared.latency import LatencyModel, load_profile
from shared.policies import (
    Continuous,
    DecodeBatchPolicy,
    DynamoLoad,
    DynamoSla,
    Edf,
    Fcfs,
    HistoricalMean,
    LengthPredictor,
    MaxTokens,
    PolicyContext,
    PrefillPolicy,
    RequestView,
    ScalingPolicy,
    make_decode_batch_policy,
    make_length_predictor,
    make_prefill_policy,
    make_scaling_policy,
)
from shared.protocol import ClusterSnapshot, InstanceInfo, InstanceLoad, LoadReport, SeriesPoint

MODEL = LatencyModel(load_profile())
CTX = PolicyContext(ttft_slo_s=2.0, tpot_slo_s=0.1, max_instances=8)
_checks: tuple[ScalingPolicy, PrefillPolicy, DecodeBatchPolicy, LengthPredictor] = (
    DynamoSla(MODEL, CTX), Fcfs(), Continuous(), MaxTokens())  # mypy: the classes satisfy their Protocols


def engine(i: str, role: str, *, queued_tokens: int = 0, running: int = 0, used: int = 0,
           status: str = "ready") -> InstanceLoad:
    info = InstanceInfo(instance_id=i, role=role, status=status, engine_kind="sim", url="sim://x",  # type: ignore[arg-type]
                        bootstrap_host="", bootstrap_port=None, model="m", profile="p", kv_capacity_tokens=380_000,
                        max_running_requests=256, sidecar="sim", registered_at_unix_s=0.0)
    load = LoadReport(instance_id=i, role=role, status=status, ts_unix_s=0.0,  # type: ignore[arg-type]
                      num_waiting_uncached_tokens=queued_tokens, num_running_reqs=running, num_used_tokens=used)
    return InstanceLoad(info=info, load=load, load_age_s=0.0)


def point(rate: float, isl: float, osl: float, interval_s: float = 60.0) -> SeriesPoint:
    n = int(rate * interval_s)
    return SeriesPoint(start_unix_s=0.0, interval_s=interval_s, arrivals=n, arrival_rate_rps=rate, completed=n,
                       mean_input_tokens=isl, mean_output_tokens=osl, mean_running_reqs=0.0, ttft_p90_s=None,
                       tpot_p90_s=None)


def snapshot(instances: list[InstanceLoad], series: list[SeriesPoint]) -> ClusterSnapshot:
    return ClusterSnapshot(ts_unix_s=0.0, instances=instances, series=series)


def test_dynamo_sla_replicas_follow_the_profile_capacity() -> None:
    policy = DynamoSla(MODEL, CTX)
    isl, osl, rate = 2000.0, 200.0, 10.0
    target = policy.decide(snapshot([engine("p0", "prefill"), engine("d0", "decode")], [point(rate, isl, osl)] * 3), 0)
    assert target is not None
    assert target.prefill == math.ceil(rate * isl / (isl / MODEL.prefill_time_s(int(isl))))
    # Decode capacity: the largest batch whose KV fits and whose step meets the TPOT SLO at context ISL + OSL/2.
    batch = max(b for b in range(1, 380_000 // 2200 + 1) if MODEL.decode_step_time_s(b, int(b * (isl + osl / 2))) <= CTX.tpot_slo_s)
    assert policy.decode_capacity_tps(isl, osl) == pytest.approx(batch / MODEL.decode_step_time_s(batch, int(batch * (isl + osl / 2))))
    assert target.decode == math.ceil(rate * osl / policy.decode_capacity_tps(isl, osl))


def test_dynamo_sla_stays_within_the_gpu_budget_and_keeps_one_of_each() -> None:
    policy = DynamoSla(MODEL, CTX)
    huge = policy.decide(snapshot([], [point(500.0, 8000, 500)]), 0)
    assert huge is not None and huge.prefill + huge.decode == 8 and huge.prefill >= 1 and huge.decode >= 1
    tiny = policy.decide(snapshot([], [point(0.05, 100, 10)]), 0)
    assert tiny is not None and (tiny.prefill, tiny.decode) == (1, 1)
    assert policy.decide(snapshot([], []), 0) is None  # nothing observed, no opinion


def test_dynamo_load_moves_one_replica_when_every_engine_crosses_the_slo() -> None:
    policy = DynamoLoad(MODEL, CTX)
    series = [point(1.0, 1000, 100, interval_s=5.0)]
    # Both prefill engines have ~10 s of prompts queued: add a prefill. Decode steps take ~15 ms, far
    # under the 100 ms SLO x 0.5: remove a decode.
    busy = [engine("p0", "prefill", queued_tokens=200_000), engine("p1", "prefill", queued_tokens=150_000),
            engine("d0", "decode", running=100, used=100_000), engine("d1", "decode", running=100, used=100_000)]
    up = policy.decide(snapshot(busy, series), 0)
    assert up is not None and (up.prefill, up.decode) == (3, 1)
    # One prefill engine under the SLO: no change for prefill (all must be over).
    mixed = [engine("p0", "prefill", queued_tokens=200_000), engine("p1", "prefill"), *busy[2:]]
    kept = policy.decide(snapshot(mixed, series), 0)
    assert kept is not None and (kept.prefill, kept.decode) == (2, 1)
    # Everything idle: remove one of each, never below one.
    idle = [engine("p0", "prefill"), engine("p1", "prefill"), engine("d0", "decode"), engine("d1", "decode")]
    down = policy.decide(snapshot(idle, series), 0)
    assert down is not None and (down.prefill, down.decode) == (1, 1)
    assert policy.decide(snapshot(idle[1:3], series), 0) is None  # already 1P1D
    assert policy.decide(snapshot(busy, []), 0) is None  # no traffic observed yet


def test_dynamo_load_gives_the_last_gpu_to_the_role_further_over_its_slo() -> None:
    ctx = PolicyContext(ttft_slo_s=2.0, tpot_slo_s=0.02, max_instances=3)
    policy = DynamoLoad(MODEL, ctx)
    series = [point(1.0, 1000, 100, interval_s=5.0)]
    both = [engine("p0", "prefill", queued_tokens=400_000), engine("d0", "decode", running=200, used=300_000)]
    target = policy.decide(snapshot(both, series), 0)
    assert target is not None and target.prefill + target.decode == 3


def test_prefill_orders() -> None:
    class Item:
        def __init__(self, rid: str, arrival_s: float, slo_ttft_s: float) -> None:
            self.rid, self.arrival_s, self.slo_ttft_s = rid, arrival_s, slo_ttft_s
            self.input_tokens, self.prefilled = 100, 0

    items = [Item("a", 0.0, 10.0), Item("b", 1.0, 0.5), Item("c", 2.0, 5.0)]
    fcfs = Fcfs().plan(items, 10_000, 3.0)
    assert [(i.rid, n) for i, n in fcfs.parts] == [("a", 100), ("b", 100), ("c", 100)] and fcfs.retry_at_s is None
    assert [i.rid for i, _ in Edf().plan(items, 10_000, 3.0).parts] == ["b", "c", "a"]
    assert [(i.rid, n) for i, n in Edf().plan(items, 150, 3.0).parts] == [("b", 100), ("c", 50)]  # a partial chunk
    assert not Fcfs().event_driven and not Edf().event_driven
    assert make_prefill_policy("edf", MODEL).name == "edf"
    with pytest.raises(ValueError, match="unknown prefill policy 'nope'; known: .*edf, fcfs"):
        make_prefill_policy("nope", MODEL)


def test_decode_batch_and_length_predictors() -> None:
    assert Continuous().selects_all and make_decode_batch_policy("continuous", MODEL).name == "continuous"
    with pytest.raises(ValueError, match="unknown decode batch policy 'nope'; known: continuous"):
        make_decode_batch_policy("nope", MODEL)
    view = RequestView(rid="r", input_tokens=100, max_output_tokens=500)
    assert MaxTokens().predict_remaining(view, 120) == 380
    mean = make_length_predictor("historical-mean")
    assert isinstance(mean, HistoricalMean)
    assert mean.predict_remaining(view, 0) == 500  # nothing seen yet: max_tokens
    for n in (100, 200, 300):
        mean.observe(50, n)
    assert mean.predict_remaining(view, 50) == 150  # mean 200 less 50 generated
    assert mean.predict_remaining(view, 250) == 200  # outlived the mean: one mean more
    assert mean.predict_remaining(view, 450) == 50  # capped by max_tokens
    with pytest.raises(ValueError, match="known: ares-noise, historical-mean, max-tokens, oracle"):
        make_length_predictor("ares")


def test_scaling_registry() -> None:
    assert make_scaling_policy("dynamo-load", MODEL, CTX).interval_s == 5.0
    assert make_scaling_policy("dynamo-sla", MODEL, CTX).interval_s == 180.0
    assert make_scaling_policy("dopd", MODEL, CTX).name == "dopd"
    with pytest.raises(ValueError, match="known: dopd, dynamo-load, dynamo-sla"):
        make_scaling_policy("hpa", MODEL, CTX)
