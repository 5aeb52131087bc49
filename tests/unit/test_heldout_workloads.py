"""The held-out set (loadgen/heldout.py): deterministic workloads whose tenants follow their documented rate
curves and length pools, loadable by name and judged by a known SLO."""

from __future__ import annotations

import hashlib
import math

import pytest

from loadgen.heldout import API_PROMPT_MAX_TOKENS, BATCH_WAVES, HELD_OUT_SHAPES, MULTI_TENANT, WEEK, load_held_out
from loadgen.slo import slo_for
from loadgen.stress import BASE_RATE_RPS, STRESS_SHAPES, code_pairs, conv_pairs
from loadgen.traces import default_traces_dir, load_trace, traces_present
from loadgen.workload import Workload

TRACES = default_traces_dir()
pytestmark = pytest.mark.skipif(not traces_present("azure-conv", "azure-code"),
                                reason=f"Azure traces not found in {TRACES}")
MINUTE = 60.0


@pytest.fixture(scope="module")
def workloads() -> dict[str, Workload]:
    return {name: load_held_out(name) for name in HELD_OUT_SHAPES}


def digest(w: Workload) -> str:
    text = "\n".join(f"{r.arrival_s:.6f} {r.input_tokens} {r.output_tokens}" for r in w)
    return hashlib.sha256(text.encode()).hexdigest()


def test_three_workloads_with_their_own_seeds() -> None:
    assert set(HELD_OUT_SHAPES) == {"heldout-batch-waves", "heldout-multi-tenant", "heldout-week"}
    seeds = [s.seed for s in HELD_OUT_SHAPES.values()] + [s.seed for s in STRESS_SHAPES.values()]
    assert len(set(seeds)) == len(seeds)


@pytest.mark.parametrize("name", list(HELD_OUT_SHAPES))
def test_rebuilt_identically_sorted_indexed_loadable_and_judged(name: str, workloads: dict[str, Workload]) -> None:
    w = workloads[name]
    assert digest(load_held_out(name)) == digest(w) and digest(load_trace(name)) == digest(w)
    times = [r.arrival_s for r in w]
    assert times == sorted(times) and [r.index for r in w] == list(range(len(w)))
    duration = HELD_OUT_SHAPES[name].duration_s
    assert 0.0 <= times[0] < 5.0 and duration - 10.0 < times[-1] <= duration
    assert slo_for(name).ttft_s == 2.0


@pytest.mark.parametrize("name", list(HELD_OUT_SHAPES))
def test_every_minute_follows_the_summed_rate_curve(name: str, workloads: dict[str, Workload]) -> None:
    """Each minute's count is within 4.5 Poisson standard deviations of the tenants' summed expected count."""
    shape = HELD_OUT_SHAPES[name]
    for minute in range(int(shape.duration_s / MINUTE)):
        steps = [minute * MINUTE + (k + 0.5) / 10 for k in range(600)]
        expected = BASE_RATE_RPS * sum(shape.multiplier(t) for t in steps) / 10
        got = sum(1 for r in workloads[name] if minute * MINUTE <= r.arrival_s < (minute + 1) * MINUTE)
        assert abs(got - expected) <= 4.5 * math.sqrt(expected), (minute, got, expected)


def test_batch_waves_bring_code_prompts_only_in_their_waves(workloads: dict[str, Workload]) -> None:
    code = set(code_pairs(None)) - set(conv_pairs(None))
    w = workloads["heldout-batch-waves"]
    in_wave = [r for r in w if (r.input_tokens, r.output_tokens) in code]
    assert in_wave and all(5 <= (r.arrival_s / MINUTE - 5) % 15 + 5 < 10 for r in in_wave)
    assert BATCH_WAVES.multiplier(6 * MINUTE) == pytest.approx(1.5) and BATCH_WAVES.multiplier(12 * MINUTE) == 0.7


def test_multi_tenant_api_bursts_are_short_prompts(workloads: dict[str, Workload]) -> None:
    # at 2.5 min: chat 0.5, the code assistant a eighth of its way up (0.1 + 0.5 x 2.5/20), the API in a burst
    assert MULTI_TENANT.multiplier(2.5 * MINUTE) == pytest.approx(0.5 + (0.1 + 0.5 * 2.5 / 20) + 3.0)
    assert MULTI_TENANT.multiplier(20 * MINUTE) == pytest.approx(0.5 + 0.6 + 0.2)
    w = workloads["heldout-multi-tenant"]
    burst = [r for r in w if 2 * MINUTE <= r.arrival_s < 3 * MINUTE]
    calm = [r for r in w if 4 * MINUTE <= r.arrival_s < 5 * MINUTE]
    short = sum(r.input_tokens <= API_PROMPT_MAX_TOKENS for r in burst) / len(burst)
    assert len(burst) > 2 * len(calm) and short > sum(r.input_tokens <= API_PROMPT_MAX_TOKENS for r in calm) / len(calm)


def test_the_week_has_five_busy_days_and_a_quiet_weekend(workloads: dict[str, Workload]) -> None:
    day = 60 * MINUTE / 7
    per_day = [sum(1 for r in workloads["heldout-week"] if d * day <= r.arrival_s < (d + 1) * day) for d in range(7)]
    assert min(per_day[:5]) > 1.5 * max(per_day[5:])
    assert WEEK.multiplier(day / 2) == pytest.approx(1.4) and WEEK.multiplier(0.0) == pytest.approx(0.3)
