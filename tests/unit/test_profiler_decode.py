"""Turning a probe stream's token arrivals into decode step samples."""

from __future__ import annotations

import pytest

from services.profiler.decode import ProbeStream, Snapshot, _window_end, token_gaps, window_samples


def test_gaps_per_token_and_coalesced_events_spread_evenly() -> None:
    events = [(1, 0.0), (2, 0.010), (4, 0.030), (5, 0.040)]
    assert token_gaps(events, 1, 5) == [(2, 0.010), (3, pytest.approx(0.010)), (4, pytest.approx(0.010)),
                                        (5, pytest.approx(0.010))]
    assert [j for j, _ in token_gaps(events, 2, 4)] == [3, 4]


def test_window_segments_mean_gap_and_context_at_their_middle() -> None:
    # 16 steps of 10 ms quantized to whole milliseconds (an event-loop timer), drifting with the deadlines.
    times = [round((0.0101 * j) * 1000) / 1000 for j in range(17)]
    events = [(j + 1, t) for j, t in enumerate(times)]
    gaps = token_gaps(events, 1, 17)
    samples = window_samples(gaps, batch=8, prompt_tokens=100, segments=2, context_at=lambda j: 800 + 8 * (j - 1),
                             time_scale=2.0, source="num_used_tokens")
    assert [s.steps for s in samples] == [8, 8]
    # The mean over a segment keeps the 10.1 ms (halved by the time scale) that single quantized gaps lose.
    assert samples[0].step_s == pytest.approx(0.0101 / 2, abs=0.0005 / 8)
    assert samples[0].context_tokens == pytest.approx(800 + 8 * (5.5 - 1))
    assert all(s.batch == 8 and s.context_source == "num_used_tokens" for s in samples)


def test_a_report_is_placed_on_the_probe_clock_by_its_own_time() -> None:
    probe = ProbeStream(events=[(1, 10.0), (2, 10.1), (3, 10.2)])
    assert [probe.count_at(t) for t in (9.9, 10.0, 10.15, 99.0)] == [0, 1, 2, 3]


def _snap(tokens: int, running: int, taken: float | None) -> Snapshot:
    return Snapshot(tokens=tokens, used_tokens=100 + tokens, running=running, waiting=0, taken_unix_s=taken)


def test_window_end_is_the_newest_report_inside_the_window_that_shows_the_whole_batch() -> None:
    start = _snap(3, 4, 100.0)
    # SGLang's reports repeat until its scheduler publishes again (every 15 steps); the last one after the
    # window shows the batch shrinking as the probe finishes: not the window's end.
    seen = [_snap(3, 4, 100.0), _snap(18, 4, 101.0), _snap(33, 4, 102.0), _snap(40, 3, 102.5)]
    assert _window_end(start, seen, upto=35) == seen[2]
    assert _window_end(start, seen[:1], upto=35) is None  # nothing newer than the start: no slope to read
    # An engine without report times (or engine_sim's, always current) counts by arrival, as before.
    assert _window_end(_snap(3, 4, None), [_snap(20, 4, None), _snap(35, 4, None)], upto=35).tokens == 35
