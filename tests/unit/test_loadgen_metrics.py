"""Metrics recomputed by hand on tiny records, failed requests included."""

from __future__ import annotations

import math

import pytest

from loadgen.metrics import percentile, summarize
from loadgen.records import RequestRecord
from loadgen.slo import SLO


def rec(
    index: int,
    sent: float,
    first: float | None,
    finished: float,
    received: int,
    *,
    expected: int | None = None,
    status: str = "ok",
    arrival: float | None = None,
) -> RequestRecord:
    return RequestRecord(
        index=index,
        rid=f"r{index}",
        arrival_s=sent if arrival is None else arrival,
        sent_s=sent,
        first_token_s=first,
        finished_s=finished,
        input_tokens=100 * (index + 1),
        output_tokens_expected=received if expected is None else expected,
        output_tokens_received=received,
        status=status,  # type: ignore[arg-type]
        error=None if status == "ok" else "HTTP 500: boom",
        http_status=200 if status == "ok" else 500,
    )


def test_percentile_matches_linear_interpolation() -> None:
    assert percentile([3.0, 1.0, 2.0], 50) == 2.0
    assert percentile([1.0, 2.0, 3.0, 4.0], 50) == 2.5
    assert percentile([1.0, 2.0, 3.0, 4.0], 90) == pytest.approx(3.7)
    assert percentile([10.0, 20.0], 99) == pytest.approx(19.9)
    assert percentile([5.0], 99) == 5.0
    assert percentile(range(101), 0) == 0 and percentile(range(101), 100) == 100
    with pytest.raises(ValueError):
        percentile([], 50)
    with pytest.raises(ValueError):
        percentile([1.0], 101)


def test_record_derived_latencies() -> None:
    r = rec(0, sent=1.0, first=1.5, finished=3.5, received=5)
    assert r.ttft_s == 0.5 and r.e2e_s == 2.5 and r.tpot_s == pytest.approx(0.5)
    assert rec(1, 1.0, 1.2, 1.2, received=1).tpot_s == 0.0
    assert rec(2, 1.0, None, 1.3, received=0, status="error").ttft_s is None
    assert rec(3, 2.0, 2.1, 2.5, 3, arrival=1.5).lateness_s == 0.5


def test_summarize_by_hand() -> None:
    slo = SLO(ttft_s=1.0, tpot_s=0.1)
    records = [
        rec(0, 0.0, 0.5, 1.4, received=10),  # ttft 0.5, tpot 0.1  -> meets both
        rec(1, 1.0, 3.0, 3.9, received=10),  # ttft 2.0, tpot 0.1 -> misses ttft
        rec(2, 2.0, 2.2, 4.2, received=5, expected=6),  # ttft 0.2, tpot 0.5 -> misses tpot; mismatch
        rec(3, 3.0, 3.4, 3.4, received=1),  # ttft 0.4, tpot 0.0 -> meets both
        rec(4, 4.0, None, 4.1, received=0, expected=8, status="error"),  # failed: counts as a miss
    ]
    s = summarize(records, slo, wall_s=5.0)
    assert (s.requests_total, s.requests_ok, s.requests_failed) == (5, 4, 1)
    ttfts = [0.5, 2.0, 0.2, 0.4]
    tpots = [0.1, 0.1, 0.5, 0.0]
    e2es = [1.4, 2.9, 2.2, 0.4]
    assert s.ttft_p50_s == pytest.approx(0.45)  # sorted .2 .4 .5 2.0 -> (0.4+0.5)/2
    assert s.ttft_p90_s == pytest.approx(0.5 + 0.7 * 1.5)
    assert s.ttft_p99_s == pytest.approx(percentile(ttfts, 99))
    assert s.tpot_p50_s == pytest.approx(0.1) and s.tpot_p99_s == pytest.approx(percentile(tpots, 99))
    assert s.e2e_p50_s == pytest.approx(percentile(e2es, 50)) == pytest.approx(1.8)
    assert s.slo_attainment == pytest.approx(2 / 5)
    assert s.ttft_attainment == pytest.approx(3 / 5)
    assert s.tpot_attainment == pytest.approx(3 / 5)
    assert s.throughput_rps == pytest.approx(4 / 5.0)
    assert s.output_tokens_total == 26 and s.output_tokens_per_s == pytest.approx(26 / 5.0)
    assert s.input_tokens_total == 100 + 200 + 300 + 400
    assert s.output_tokens_expected_total == 10 + 10 + 6 + 1 + 8
    assert s.token_mismatches == 1
    assert s.lateness_max_s == 0.0
    assert (s.slo_ttft_s, s.slo_tpot_s, s.wall_s) == (1.0, 0.1, 5.0)


def test_summarize_edge_cases() -> None:
    slo = SLO(ttft_s=1.0, tpot_s=0.1)
    empty = summarize([], slo, wall_s=0.0)
    assert empty.requests_total == 0 and empty.slo_attainment == 0.0 and empty.ttft_p50_s is None
    assert empty.throughput_rps == 0.0 and empty.lateness_max_s is None
    failed = summarize([rec(0, 0.0, None, 1.0, 0, expected=3, status="error")], slo, wall_s=1.0)
    assert failed.requests_failed == 1 and failed.slo_attainment == 0.0 and failed.tpot_p50_s is None
    assert failed.token_mismatches == 0  # only successful requests count as mismatches
    # An "ok" request without any token cannot meet the TTFT target.
    no_token = summarize([rec(0, 0.0, None, 1.0, 0, expected=3)], slo, wall_s=1.0)
    assert no_token.slo_attainment == 0.0 and no_token.tpot_attainment == 1.0
    assert math.isclose(no_token.e2e_p50_s or 0.0, 1.0)


def _work_rec(index: int, prompt: int, output: int, *, ttft: float = 0.1, status: str = "ok",
              http_status: int = 200) -> RequestRecord:
    return RequestRecord(index=index, rid=f"r{index}", arrival_s=0.0, sent_s=0.0, first_token_s=ttft,
                         finished_s=ttft + 0.01 * (output - 1), input_tokens=prompt, output_tokens_expected=output,
                         output_tokens_received=output if status == "ok" else 0, status=status,  # type: ignore[arg-type]
                         error=None if status == "ok" else f"HTTP {http_status}", http_status=http_status)


def test_the_work_view_weighs_by_tokens_and_names_the_refused_and_the_late() -> None:
    """Refusing the one long prompt keeps 3 of 4 requests in time but only a small share of the work."""
    records = [_work_rec(0, 100, 10), _work_rec(1, 200, 10), _work_rec(2, 300, 10, ttft=5.0),  # served late
               _work_rec(3, 9000, 500, status="error", http_status=429), _work_rec(4, 150, 10),
               _work_rec(5, 120, 10, status="error", http_status=500)]  # failed, not refused
    s = summarize(records, SLO(ttft_s=1.0, tpot_s=0.1), 10.0)
    total = sum(r.input_tokens + r.output_tokens_expected for r in records)
    assert s.slo_attainment == pytest.approx(3 / 6)
    assert s.token_attainment == pytest.approx((110 + 210 + 160) / total)
    assert s.refused_share == pytest.approx(1 / 6) and s.refused_token_share == pytest.approx(9500 / total)
    assert s.late_share == pytest.approx(1 / 6)
    # By prompt length, rank * 4 // 6: [100, 120 failed] [150] [200, 300 late] [9000 refused].
    assert s.quartile_attainment == pytest.approx([0.5, 1.0, 0.5, 0.0])
    empty = summarize([], SLO(ttft_s=1.0, tpot_s=0.1), 0.0)
    assert (empty.token_attainment, empty.refused_share, empty.quartile_attainment) == (0.0, 0.0, [])
