"""The monitor's rolling series, fed by hand-made events and loads."""

from __future__ import annotations

import pytest

from shared.protocol import LoadReport, RequestEvent, SeriesPoint
from shared.series import SeriesBuilder, merge_points, percentile


def _event(rid: str, *, status: str = "ok", inp: int = 100, out: int = 10, ttft: float | None = 0.1,
           tpot: float | None = 0.02, prefill_id: str | None = "p0") -> RequestEvent:
    return RequestEvent(rid=rid, model="m", arrived_unix_s=1000.0, finished_unix_s=1001.0, prefill_id=prefill_id,
                        decode_id="d0", input_tokens=inp, output_tokens=out, ttft_s=ttft, tpot_s=tpot,
                        status=status)  # type: ignore[arg-type]


def _load(instance: str, running: int, *, healthy: bool = True) -> LoadReport:
    return LoadReport(instance_id=instance, role="decode", status="ready", ts_unix_s=1000.0, healthy=healthy,
                      num_running_reqs=running)


def test_empty_interval() -> None:
    b = SeriesBuilder(start_unix_s=1000.0)
    p = b.roll(1005.0)
    assert (p.start_unix_s, p.interval_s, p.arrivals, p.arrival_rate_rps, p.completed) == (1000.0, 5.0, 0, 0.0, 0)
    assert (p.mean_input_tokens, p.mean_output_tokens, p.mean_running_reqs) == (0.0, 0.0, 0.0)
    assert p.ttft_p90_s is None and p.tpot_p90_s is None


def test_one_interval() -> None:
    b = SeriesBuilder(start_unix_s=1000.0)
    for i in range(10):  # ttft 0.1 .. 1.0, tpot 0.01 .. 0.10
        b.add_event(_event(f"r{i}", inp=100 * (i + 1), out=10 * (i + 1), ttft=0.1 * (i + 1), tpot=0.01 * (i + 1)))
    b.add_event(_event("bad", status="error", inp=99999, out=0, ttft=None, tpot=None))
    b.add_event(_event("gone", status="aborted", ttft=50.0))
    b.add_event(_event("no-latency", ttft=None, tpot=None, inp=550, out=55))
    p = b.roll(1005.0)
    assert p.arrivals == 13 and p.completed == 11
    assert p.arrival_rate_rps == pytest.approx(13 / 5)
    assert p.mean_input_tokens == pytest.approx((5500 + 550) / 11)
    assert p.mean_output_tokens == pytest.approx((550 + 55) / 11)
    assert p.ttft_p90_s == pytest.approx(0.9)  # nearest rank 9 of 10; failed requests do not count
    assert p.tpot_p90_s == pytest.approx(0.09)


def test_requests_prefilled_on_their_decode_instance_are_counted_apart() -> None:
    b = SeriesBuilder(start_unix_s=0.0)
    b.add_event(_event("remote", inp=2000))
    b.add_event(_event("local-a", inp=100, prefill_id=None))  # DOPD's local prefill: no prefill instance
    b.add_event(_event("local-b", inp=300, prefill_id=None))
    b.add_event(_event("local-failed", inp=50, prefill_id=None, status="error"))  # not completed: not counted
    p = b.roll(5.0)
    assert p.completed == 3 and p.local_prefilled == 2
    assert p.mean_local_input_tokens == pytest.approx(200.0)
    assert p.mean_input_tokens == pytest.approx(2400 / 3)
    empty = b.roll(10.0)
    assert (empty.local_prefilled, empty.mean_local_input_tokens) == (0, 0.0)


def test_mean_running_is_per_instance_mean_summed() -> None:
    b = SeriesBuilder(start_unix_s=0.0)
    for r in (2, 4, 6):
        b.add_load(_load("d0", r))  # mean 4
    b.add_load(_load("d1", 10))  # mean 10 (one sample)
    b.add_load(_load("d1", 999, healthy=False))  # unhealthy samples are ignored
    assert b.roll(5.0).mean_running_reqs == pytest.approx(14.0)


def test_roll_starts_a_fresh_interval() -> None:
    b = SeriesBuilder(start_unix_s=0.0)
    b.add_event(_event("a"))
    b.add_load(_load("d0", 3))
    first = b.roll(5.0)
    b.add_event(_event("b", inp=7, out=3))
    second = b.roll(12.0)
    assert (first.arrivals, second.arrivals) == (1, 1)
    assert second.start_unix_s == 5.0 and second.interval_s == 7.0
    assert second.arrival_rate_rps == pytest.approx(1 / 7)
    assert second.mean_input_tokens == 7 and second.mean_running_reqs == 0.0


def test_zero_length_interval_has_zero_rate() -> None:
    b = SeriesBuilder(start_unix_s=10.0)
    b.add_event(_event("a"))
    assert b.roll(10.0).arrival_rate_rps == 0.0


@pytest.mark.parametrize(("values", "q", "expected"), [
    ([], 90, None), ([3.0], 90, 3.0), ([1.0, 2.0], 50, 1.0), ([1.0, 2.0], 90, 2.0), ([5.0, 1.0, 3.0], 0, 1.0),
])
def test_percentile(values: list[float], q: float, expected: float | None) -> None:
    assert percentile(values, q) == expected


def test_merged_points_weigh_means_by_completed_and_sum_counts() -> None:
    def point(start: float, completed: int, isl: float, local: int, local_isl: float) -> SeriesPoint:
        return SeriesPoint(start_unix_s=start, interval_s=5.0, arrivals=completed + 1, arrival_rate_rps=0.0,
                           completed=completed, mean_input_tokens=isl, mean_output_tokens=10.0,
                           mean_running_reqs=4.0 * completed, ttft_p90_s=0.1, tpot_p90_s=0.01,
                           local_prefilled=local, mean_local_input_tokens=local_isl,
                           mean_input_tokens_sq=isl * isl)

    merged = merge_points([point(0.0, 1, 100.0, 1, 100.0), point(5.0, 3, 500.0, 1, 300.0)])
    assert merged is not None
    assert (merged.start_unix_s, merged.interval_s, merged.arrivals, merged.completed) == (0.0, 10.0, 6, 4)
    assert merged.arrival_rate_rps == 0.6 and merged.mean_running_reqs == 8.0
    assert merged.mean_input_tokens == 400.0 and merged.mean_input_tokens_sq == (100.0**2 + 3 * 500.0**2) / 4
    assert merged.local_prefilled == 2 and merged.mean_local_input_tokens == 200.0
    assert merged.ttft_p90_s is None and merge_points([]) is None
