"""The switching oracle: window counts, the per-window choice, and agreement with the simulator's summary."""

from __future__ import annotations

import pytest

from loadgen.records import RequestRecord
from loadgen.sim.baselines import make_mix
from loadgen.sim.run import simulate
from loadgen.slo import SLO, slo_for
from loadgen.switching_oracle import grid_goodput, rate_grid, switching_oracle, window_hits
from loadgen.traces import load_trace
from shared.latency import LatencyModel, load_profile

SLO_1S = SLO(ttft_s=1.0, tpot_s=0.1)


def record(i: int, arrival: float, ttft: float, *, ok: bool = True) -> RequestRecord:
    """A two-token request: TPOT 0.05 s (within SLO_1S), TTFT ``ttft``."""
    first = arrival + ttft
    return RequestRecord(index=i, rid=f"r{i}", arrival_s=arrival, sent_s=arrival, first_token_s=first if ok else None,
                         finished_s=first + 0.05, input_tokens=10, output_tokens_expected=2,
                         output_tokens_received=2 if ok else 0, status="ok" if ok else "error")


def test_windows_count_hits_by_arrival_after_the_warm_up_and_a_failure_is_a_miss() -> None:
    records = [record(0, 5.0, 0.1),  # warm-up: not counted
               record(1, 10.0, 0.5), record(2, 19.9, 2.0),  # window 0: one hit, one late
               record(3, 20.0, 0.1), record(4, 25.0, 0.1, ok=False),  # window 1: one hit, one failed
               record(5, 41.0, 0.9)]  # window 3 (window 2 empty)
    assert window_hits(records, SLO_1S, start_s=10.0, window_s=10.0) == [(1, 2), (1, 2), (0, 0), (1, 1)]
    assert window_hits([], SLO_1S, 0.0, 10.0) == []
    with pytest.raises(ValueError, match="window_s"):
        window_hits(records, SLO_1S, 0.0, 0.0)


def test_the_oracle_takes_each_windows_best_and_a_tie_switches_nothing() -> None:
    per_config = {
        "4P4D": [(9, 10), (2, 10), (5, 10), (5, 10)],
        "6P2D": [(3, 10), (8, 10), (5, 10), (4, 10)],
        "colocated": [(9, 10), (1, 10), (5, 10), (6, 10)],
    }
    choice = switching_oracle(per_config)
    assert choice.attainment == pytest.approx((9 + 8 + 5 + 6) / 40)
    # Window 0 ties 4P4D (the best fixed, 21 hits) with colocated; window 2 ties all three: stay on 6P2D.
    assert choice.schedule == ["4P4D", "6P2D", "6P2D", "colocated"]
    assert choice.switches == 2
    assert (choice.best_fixed, choice.best_fixed_attainment) == ("4P4D", pytest.approx(21 / 40))
    one_window = switching_oracle({name: [(sum(h for h, _ in c), 40)] for name, c in per_config.items()})
    assert one_window.attainment == one_window.best_fixed_attainment  # one window: the best fixed configuration


def test_configurations_that_served_different_requests_are_refused() -> None:
    with pytest.raises(ValueError, match="same requests"):
        switching_oracle({"a": [(1, 2), (1, 1)], "b": [(1, 2), (1, 2)]})
    with pytest.raises(ValueError, match="no configurations"):
        switching_oracle({})


def test_grid_goodput_stops_at_the_first_failing_rate_and_the_grid_reaches_its_top() -> None:
    assert grid_goodput({1.0: 0.95, 2.0: 0.85, 3.0: 0.95}, 0.9) == 1.0  # a pass above a cliff does not count
    assert grid_goodput({2.0: 0.5}, 0.9) == 0.0
    grid = rate_grid(7.25, 8.125, 3)
    assert grid[0] == 7.25 and grid[-1] >= 8.125 and len(grid) == 3 and grid == sorted(grid)
    assert rate_grid(2.0, 2.0, 3) == [2.0]


def test_the_windows_add_up_to_the_simulators_own_attainment() -> None:
    """window_hits judges requests as the summary does: over one run its hits are the summary's attainment,
    and the oracle over two splits is at least as good as either."""
    workload = load_trace("azure-code").slice(0.0, 300.0)
    slo = slo_for("azure-code")
    model = LatencyModel(load_profile())
    counts = {}
    for split in ("4P4D", "7P1D"):
        result = simulate(workload, make_mix("static-minload", 8, split), model, slo, rate_scale=6.0,
                          rate_mode="natural", warmup_s=60.0)
        counts[split] = window_hits(result.records, slo, 60.0, 60.0)
        hits, total = sum(h for h, _ in counts[split]), sum(n for _, n in counts[split])
        assert total == result.summary.requests_total
        assert hits / total == pytest.approx(result.summary.slo_attainment)
    choice = switching_oracle(counts)
    assert choice.attainment >= max(sum(h for h, _ in c) for c in counts.values()) / sum(n for _, n in counts["4P4D"])
