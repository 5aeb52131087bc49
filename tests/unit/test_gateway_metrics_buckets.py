"""The gateway's latency histograms are fine enough to read a percentile from."""

from __future__ import annotations

from services.gateway.metrics import LATENCY_BUCKETS, SLO_TPOT_BOUNDS, SLO_TTFT_BOUNDS, TPOT_BUCKETS, GatewayMetrics


def test_buckets_step_at_most_28_percent_over_their_whole_range_and_hold_the_slo_targets() -> None:
    for buckets, low, high, targets in ((LATENCY_BUCKETS, 0.005, 300.0, SLO_TTFT_BOUNDS),
                                        (TPOT_BUCKETS, 0.002, 2.0, SLO_TPOT_BOUNDS)):
        assert buckets[0] == low and buckets[-1] >= high and set(targets) <= set(buckets)
        assert all(1.0 < b / a <= 1.28 for a, b in zip(buckets, buckets[1:], strict=False)), buckets


def test_the_gateways_own_slo_is_a_bound() -> None:
    from prometheus_client import generate_latest

    text = generate_latest(GatewayMetrics(slo_ttft_s=1.7, slo_tpot_s=0.042).registry).decode()
    assert 'poise_gateway_ttft_seconds_bucket{le="1.7"}' in text and 'poise_gateway_tpot_seconds_bucket{le="0.042"}' in text
