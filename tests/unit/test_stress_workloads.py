"""The stress set: deterministic workloads whose rate and length mix follow their documented shapes."""

from __future__ import annotations

import math

import pytest

from loadgen.slo import TRACE_SLOS, slo_for
from loadgen.stress import (
    BASE_RATE_RPS,
    BURSTS,
    MIX_SHIFT,
    SHORT_PROMPT_MAX_TOKENS,
    STRESS_SHAPES,
    STRESS_WORKLOADS,
    load_stress,
)
from loadgen.traces import default_traces_dir, load_trace, traces_present
from loadgen.workload import Workload

TRACES = default_traces_dir()
pytestmark = pytest.mark.skipif(not traces_present("azure-conv", "azure-code"),
                                reason=f"Azure traces not found in {TRACES}")

MINUTE = 60.0


@pytest.fixture(scope="module")
def workloads() -> dict[str, Workload]:
    return {name: load_stress(name) for name in STRESS_WORKLOADS}


def count(w: Workload, start_min: float, end_min: float) -> int:
    return sum(1 for r in w if start_min * MINUTE <= r.arrival_s < end_min * MINUTE)


def mean_input(w: Workload, start_min: float, end_min: float) -> float:
    inputs = [r.input_tokens for r in w if start_min * MINUTE <= r.arrival_s < end_min * MINUTE]
    return sum(inputs) / len(inputs)


def test_the_set_has_one_shape_per_workload() -> None:
    assert set(STRESS_WORKLOADS) == set(STRESS_SHAPES) == {
        "stress-step", "stress-ramp", "stress-bursts", "stress-mix-shift", "stress-diurnal"}
    assert len({shape.seed for shape in STRESS_SHAPES.values()}) == len(STRESS_SHAPES)


@pytest.mark.parametrize("name", list(STRESS_WORKLOADS))
def test_deterministic_sorted_indexed_and_as_long_as_intended(name: str, workloads: dict[str, Workload]) -> None:
    w = workloads[name]
    assert load_stress(name) == w
    assert w.name == name
    times = [r.arrival_s for r in w]
    assert times == sorted(times)
    assert [r.index for r in w] == list(range(len(w)))
    duration = STRESS_SHAPES[name].duration_s
    assert 0.0 <= times[0] < 5.0 and duration - 5.0 < times[-1] <= duration
    assert all(r.input_tokens > 0 and r.output_tokens > 0 for r in w)


@pytest.mark.parametrize("name", list(STRESS_WORKLOADS))
def test_every_minute_follows_the_rate_curve(name: str, workloads: dict[str, Workload]) -> None:
    """Each minute's count is within 4.5 Poisson standard deviations of the curve's expected count."""
    shape = STRESS_SHAPES[name]
    w = workloads[name]
    for minute in range(int(shape.duration_s / MINUTE)):
        steps = [minute * MINUTE + (k + 0.5) / 10 for k in range(600)]  # 0.1-s midpoints
        expected = BASE_RATE_RPS * sum(shape.multiplier(t) for t in steps) / 10
        got = count(w, minute, minute + 1)
        assert abs(got - expected) <= 4.5 * math.sqrt(expected), (minute, got, expected)


def test_step_triples_the_rate(workloads: dict[str, Workload]) -> None:
    w = workloads["stress-step"]
    assert count(w, 20, 30) / count(w, 0, 10) == pytest.approx(3.0, rel=0.15)
    assert count(w, 0, 10) / (10 * MINUTE) == pytest.approx(0.5 * BASE_RATE_RPS, rel=0.1)


def test_ramp_rises(workloads: dict[str, Workload]) -> None:
    w = workloads["stress-ramp"]
    assert count(w, 25, 30) > 4 * count(w, 0, 5)
    assert w.mean_rate_rps == pytest.approx(BASE_RATE_RPS, rel=0.05)


def test_bursts_are_ten_times_the_base_rate(workloads: dict[str, Workload]) -> None:
    w = workloads["stress-bursts"]
    windows = BURSTS.windows()
    assert [start / MINUTE for start, _ in windows] == [3, 8, 13, 18, 23, 28]
    inside = sum(count(w, start / MINUTE, end / MINUTE) for start, end in windows)
    inside_s = sum(end - start for start, end in windows)
    outside_rate = (len(w) - inside) / (BURSTS.duration_s - inside_s)
    assert outside_rate == pytest.approx(BASE_RATE_RPS, rel=0.05)
    for start, end in windows:
        assert count(w, start / MINUTE, end / MINUTE) / (end - start) / outside_rate == pytest.approx(10.0, rel=0.15)


def test_mix_shift_keeps_the_rate_and_moves_to_long_prompts(workloads: dict[str, Workload]) -> None:
    w = workloads["stress-mix-shift"]
    assert count(w, 20, 30) / count(w, 0, 10) == pytest.approx(1.0, rel=0.1)
    assert max(r.input_tokens for r in w if r.arrival_s < MIX_SHIFT.blend_start_s) <= SHORT_PROMPT_MAX_TOKENS
    assert mean_input(w, 20, 30) >= 2 * mean_input(w, 0, 10)
    assert mean_input(w, 10, 15) < mean_input(w, 15, 20)  # the blend is gradual
    code_inputs = {r.input_tokens for r in load_trace("azure-code")}
    late = [r for r in w if r.arrival_s >= MIX_SHIFT.blend_end_s]
    assert all(r.input_tokens in code_inputs for r in late)


def test_diurnal_peaks_in_the_middle(workloads: dict[str, Workload]) -> None:
    w = workloads["stress-diurnal"]
    assert count(w, 15, 25) / 10 > 3 * count(w, 0, 5) / 5
    assert count(w, 35, 40) < count(w, 15, 20) / 2  # and comes back down


def test_load_trace_and_slos_know_the_names() -> None:
    w = load_trace("stress-step")
    assert w.name == "stress-step" and w == load_stress("stress-step")
    conv = slo_for("azure-conv")
    for name in STRESS_WORKLOADS:
        assert name in TRACE_SLOS and slo_for(name) == conv


def test_an_unknown_name_lists_the_known_ones() -> None:
    with pytest.raises(ValueError, match="stress-step.*stress-diurnal"):
        load_stress("stress-nope")
    with pytest.raises(FileNotFoundError, match="stress-ramp"):
        load_trace("stress-nope")
