"""Planning on uncached prefill: the engines' cached-token counts reach the monitor's series through the
request events, and the capacity models (Poise's split scoring, DOPD's ratio) price a prefill instance only
for the part of each prompt it computed."""

from __future__ import annotations

import msgspec
import pytest

from shared.latency import LatencyModel, load_profile
from shared.policies import PolicyContext
from shared.policies.dopd import optimal_split
from shared.policies.split_capacity import Mix, best_split, prefill_seconds, split_loads
from shared.protocol import RequestEvent
from shared.series import SeriesBuilder, merge_points

MODEL = LatencyModel(load_profile())
CTX = PolicyContext(ttft_slo_s=30.0, tpot_slo_s=0.1, max_instances=8)


def event(rid: str, inp: int, cached: int, prefill_id: str | None = "p0") -> RequestEvent:
    return RequestEvent(rid=rid, model="m", arrived_unix_s=0.0, finished_unix_s=1.0, prefill_id=prefill_id,
                        decode_id="d0", input_tokens=inp, output_tokens=10, ttft_s=0.5, tpot_s=0.02, status="ok",
                        cached_tokens=cached)


def test_the_series_carries_what_prefill_instances_found_cached() -> None:
    b = SeriesBuilder(start_unix_s=0.0)
    b.add_event(event("a", 8000, 6000))
    b.add_event(event("b", 8000, 2000))
    b.add_event(event("c", 100, 50, prefill_id=None))  # prefilled on its decode instance: not a prefill hit
    b.add_event(event("d", 4000, 0))
    p = b.roll(10.0)
    assert p.mean_cached_input_tokens == pytest.approx(8000 / 4)
    assert p.mean_cached_input_tokens_sq == pytest.approx((6000**2 + 2000**2) / 4)
    merged = merge_points([p, SeriesBuilder(10.0).roll(20.0)])
    assert merged is not None and merged.mean_cached_input_tokens == pytest.approx(2000)


def test_a_cached_prefix_takes_its_work_off_the_prefill_price() -> None:
    whole = Mix(rate_rps=2.0, isl=12_000, osl=300, isl_sq=12_000.0**2, osl_sq=300.0**2, isl_osl=12_000 * 300)
    half = msgspec.structs.replace(whole, cached=6_000, cached_sq=6_000.0**2)
    # Equal lengths: exactly one prompt's prefill after its cached prefix.
    assert prefill_seconds(MODEL, half) == pytest.approx(MODEL.prefill_time_s(6_000, 6_000))
    assert prefill_seconds(MODEL, half) < prefill_seconds(MODEL, whole)
    # With half of every prompt cached, the best split of eight moves towards decode.
    before = best_split(split_loads(MODEL, whole, 8, 0.1, ttft_slo_s=30.0))
    after = best_split(split_loads(MODEL, half, 8, 0.1, ttft_slo_s=30.0))
    assert after.prefill < before.prefill


def test_dopds_ratio_prices_the_uncached_part_of_a_prompt() -> None:
    plain = optimal_split(MODEL, CTX, 12_000, 300, concurrency=40.0, rate_rps=2.0)
    cached = optimal_split(MODEL, CTX, 12_000, 300, concurrency=40.0, rate_rps=2.0, cached=6_000)
    assert cached.t_prefill_s == pytest.approx(MODEL.prefill_time_s(6_000, 6_000))
    assert cached.t_prefill_s < plain.t_prefill_s and cached.ratio < plain.ratio
    assert optimal_split(MODEL, CTX, 12_000, 300, concurrency=40.0, rate_rps=2.0, cached=0.0) == plain
