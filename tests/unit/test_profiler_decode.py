"""Turning a probe stream's token arrivals into decode step samples."""

from __future__ import annotations

import pytest

from services.profiler.decode import token_gaps, window_samples


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
