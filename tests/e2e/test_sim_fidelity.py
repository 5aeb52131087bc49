"""Simulator fidelity, the short check: one trace slice through the live stack and through the simulator.

The issue's bar: P50/P90 TTFT and P50/P90 TPOT within 10%, SLO attainment within 3 points. The live side is
the real stack (NATS, etcd, gateway, control plane, 2P+2D engine_sim with the default H100 profile); the
simulator runs the same mix (``static-minload`` 2P2D: the gateway's least-load policy). The longer check, on
five slices, is ``python -m tests.bench.sim_fidelity`` (``tests/bench/results/sim_fidelity.md``).

Three replays on one stack, ~85 s in all (stack start and stop included; twice that on a starved host):

1. **calibration**, Azure conversation 40-55 s before the check and 55-70 s after it (85 and about as many
   requests, inside the benchmark's calibration slice): live minus bare-model TTFT per request, over both,
   gives this host's serving-path delay before the first token (``FirstTokenDelay.fit``), the one free
   parameter of the simulator. ``overhead.py``'s default (median
   10.7 ms) was measured on a quiet 2-core VM; on that VM with other CPU-heavy work running, the delay
   measured here went from ~15 ms (quiet) to 16-24 ms, the live P50 TTFT up by as much as 12%, TPOT not at
   all. With a fixed delay this test would test the runner's speed, so it measures the runner instead (the
   default's numbers are printed for comparison).
2. **the check**, Azure conversation 1380-1420 s at 1x (273 requests), predicted with that delay. Why this
   slice: it is held out (not in the calibration slice, overlapping none of the benchmark's slices), and its
   P90 TTFT lies inside the cluster of long prompts (19% of its requests have prompts over 3000 tokens), so
   it is set by prefill time and queueing behind long prompts, which the model covers. Where long prompts
   are 5-10% of a slice, its P90 sits in the gap between short and long prompts and is decided by a handful
   of short requests that arrive within milliseconds of a long one; there the live stack's own P90 varies
   by +-10% between runs of the same slice (103-125 ms over four runs of Azure conversation 240-300 s) and
   the simulator misses it by 10-25%, because the gateway and the simulator place such bursts on different
   prefill engines (see ``tests/bench/sim_fidelity.py``). A 40-second slice like that would fail on noise.

SLO attainment is 100% on both sides at this load (SLO 2 s TTFT / 150 ms TPOT), so that part of the bar only
catches failed or stalled requests here, not small modelling errors.

Errors seen on the shared 2-core VM (8 runs): TPOT at most 0.6%, P90 TTFT at most 2.4%, P50 TTFT 1.0-8.6%.
The P50 margin is the thin one: when other work starts or stops between the calibration and the
check, the measured delay is off for the check (8.6% in the run where the calibration was contended and the
check was not; 1.8% in a quiet run; +10.2%, live faster than predicted, with only a calibration before the
check while two benchmark processes and the rest of the suite shared the two cores). Calibrating on both
sides of the check brackets a load that changes while it runs.

A host too busy to run the stand-in at its model's pace makes the live side measure the host. Two runs on CI
runners did: TPOT 10-16% over the model's (the decode engines' steps started late), and TTFT P90 3.5x the
prediction with a serving-path delay P90 of 641 ms (two benchmark processes beside the suite). engine_sim
counts the time its steps fall behind the model (``poise:engine_sim_behind_model_seconds_total``). Past 1% of
the check lost by one engine, or a delay P90 of 100 ms, the measurement is taken again; if the host is still
that busy the test is skipped with the numbers that say so (and this VM's CPU steal time), never passed.

Where the 1% comes from: 16 runs of the check on the shared 2-core VM (2026-11-29, bounds lifted; idle, and
beside one to three CPU-bound processes), by the most one engine lost in the 40 s. The seven that lost under
0.4 s (0.015-0.375 s) all met the bar, TTFT P50 within 8.2%, TPOT within 0.4%. Of the five that lost
0.44-1.2 s, two failed on TTFT P50 (+12%, +18%: the same host lateness in the calibration slices had inflated
the delay the prediction used) and one passed with TPOT P90 7% over. All four that lost 2.2-3.8 s failed,
TPOT P90 12-15% over: about five points per second lost. The lateness came in bursts from outside the stack:
idle runs lost as much as busy ones, while the hypervisor took 4-12% of the VM's CPU (steal time, up to 27%
over 5 s); a bound at 2% would have let both TTFT P50 failures through.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from pathlib import Path

import pytest

from loadgen.metrics import Summary
from loadgen.replay import ReplayResult, replay
from loadgen.sim.overhead import HANDSHAKE_ONLY, HANDSHAKE_S, LIVE_STACK_DELAY, FirstTokenDelay
from loadgen.slo import SLO, slo_for
from loadgen.traces import load_trace
from loadgen.workload import Workload
from services.cli.stack import Stack, StackSettings
from shared.latency import LatencyModel, load_profile
from tests.bench.sim_fidelity import (
    METRICS,
    behind_model_s,
    compare,
    cpu_ticks,
    first_token_deltas,
    misses,
    simulate_mix,
    steal_share,
)

pytestmark = pytest.mark.e2e

TRACE, START_S, DURATION_S, RATE_SCALE = "azure-conv", 1380.0, 40.0, 1.0
# Before and after the check, inside the benchmark's calibration slice (0-120 s).
CALIBRATION_SLICES = ((40.0, 15.0), (55.0, 15.0))
# Past either bound the host, not the model, sets the live numbers (see the module's docstring): 1% of the
# check's duration lost by one engine (every run here under it met the bar; above it, six of nine did not),
# and a serving-path delay whose P90 is ten times the quiet VM's.
BEHIND_MODEL_BOUND = 0.01
HOST_DELAY_P90_BOUND_S = 0.100
ATTEMPTS = 2


@dataclass
class Measurement:
    calibrations: list[tuple[Workload, ReplayResult]]
    live: Summary
    behind_model_s: float  # the most seconds one engine fell behind its latency model during the check
    steal: float | None  # the hypervisor's share of this VM's CPU time during the check (None: not on Linux)


def measure(stack: Stack, before: Workload, workload: Workload, after: Workload, slo: SLO) -> Measurement:
    def run(slice_: Workload, rate: float = 1.0) -> ReplayResult:
        return asyncio.run(replay(slice_, stack.gateway_url, model=stack.settings.model, slo=slo, rate_scale=rate,
                                  timeout_s=120, api_key=stack.api_key))

    calibrations = [(before, run(before))]
    lag_before, ticks_before = behind_model_s(stack), cpu_ticks()
    live = run(workload, RATE_SCALE).summary
    lag_after, ticks_after = behind_model_s(stack), cpu_ticks()
    calibrations.append((after, run(after)))
    return Measurement(calibrations, live, max(lag_after[i] - lag_before.get(i, 0.0) for i in lag_after),
                       steal_share(ticks_before, ticks_after))


def test_live_stack_and_simulator_agree_on_a_short_slice(tmp_path: Path) -> None:
    trace, slo = load_trace(TRACE), slo_for(TRACE)
    before, after = (trace.slice(start, duration) for start, duration in CALIBRATION_SLICES)
    workload = trace.slice(START_S, DURATION_S)
    settings = StackSettings(prefill=2, decode=2, gateway_port=0, monitor_port=0, run_dir=tmp_path / "stack", state_dir=tmp_path,
                             planner_policy="static")  # the static-minload mix the simulator runs
    model = LatencyModel(load_profile(settings.profile))
    stack = Stack(settings, progress=print)
    stack.start()
    try:
        for attempt in range(1, ATTEMPTS + 1):
            m = measure(stack, before, workload, after, slo)
            # This host's serving-path delay, measured on the calibration slices (what overhead.py holds for the
            # VM it was calibrated on); the test slice is then predicted with it.
            deltas = [d for slice_, measured in m.calibrations
                      for d in first_token_deltas(measured.records,
                                                  simulate_mix(slice_, model, slo, delay=HANDSHAKE_ONLY).records)]
            host = FirstTokenDelay.fit(sorted(deltas), handshake_s=HANDSHAKE_S)
            starved = [why for why, bad in (
                (f"an engine ran {m.behind_model_s:.2f} s behind its latency model in the {DURATION_S:g}-s check",
                 m.behind_model_s > BEHIND_MODEL_BOUND * DURATION_S),
                (f"the serving path's first-token delay had a P90 of {host.p90_s * 1e3:.0f} ms",
                 host.p90_s > HOST_DELAY_P90_BOUND_S)) if bad]
            steal = "" if m.steal is None else f"; CPU steal time in the check: {m.steal:.1%}"
            print(f"attempt {attempt}: first-token delay on this host: median {host.median_s * 1e3:.1f} ms, "
                  f"p90 {host.p90_s * 1e3:.1f} ms (overhead.py: {LIVE_STACK_DELAY.median_s * 1e3:.1f} / "
                  f"{LIVE_STACK_DELAY.p90_s * 1e3:.1f} ms); most time an engine ran behind the model in the check: "
                  f"{m.behind_model_s:.3f} s{steal}")
            if not starved:
                break
    finally:
        stack.stop()
    if starved:
        pytest.skip(f"this host could not run the live stack at the model's pace ({'; '.join(starved)}, "
                    f"{ATTEMPTS} attempts{steal}): the live numbers would measure the host, not the simulator")
    sim = simulate_mix(workload, model, slo, RATE_SCALE, host).summary

    assert all(measured.summary.requests_failed == 0 for _, measured in m.calibrations)
    live = m.live
    assert live.requests_total == len(workload.requests) == sim.requests_total
    assert live.requests_failed == 0 and sim.requests_failed == 0
    row = compare(live, sim)
    fixed = compare(live, simulate_mix(workload, model, slo, RATE_SCALE, LIVE_STACK_DELAY).summary)
    for name, r in (("host delay", row), ("overhead.py delay", fixed)):
        print(name, {k: (round(r[k]["live_ms"], 2), round(r[k]["sim_ms"], 2), round(r[k]["error_pct"], 1))
                     for k in METRICS}, r["attainment"])
    problems = misses(row)
    assert not problems, (f"{TRACE} {START_S:g}-{START_S + DURATION_S:g} s x{RATE_SCALE:g}: live stack and simulator "
                          "disagree beyond the issue's bar:\n" + "\n".join(problems))
