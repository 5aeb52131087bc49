"""The gateway's latency histograms are fine enough to read a percentile from."""

from __future__ import annotations

from services.gateway.metrics import LATENCY_BUCKETS, TPOT_BUCKETS


def test_buckets_step_at_most_28_percent_over_their_whole_range() -> None:
    for buckets, low, high in ((LATENCY_BUCKETS, 0.005, 300.0), (TPOT_BUCKETS, 0.002, 2.0)):
        assert buckets[0] == low and buckets[-1] >= high
        assert all(1.2 < b / a <= 1.28 for a, b in zip(buckets, buckets[1:], strict=False)), buckets
