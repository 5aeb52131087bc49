"""Simulator fidelity, the short check: one trace slice through the live stack and through the simulator.

The issue's bar: P50/P90 TTFT and P50/P90 TPOT within 10%, SLO attainment within 3 points. The live side is
the real stack (NATS, etcd, gateway, control plane, 2P+2D engine_sim with the default H100 profile); the
simulator runs the same mix (``static-minload`` 2P2D: the gateway's least-load policy). The longer check, on
five slices, is ``python -m tests.bench.sim_fidelity`` (``tests/bench/results/sim_fidelity.md``).

Three replays on one stack, ~85 s in all (stack start and stop included):

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
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from loadgen.replay import ReplayResult, replay
from loadgen.sim.overhead import HANDSHAKE_ONLY, HANDSHAKE_S, LIVE_STACK_DELAY, FirstTokenDelay
from loadgen.slo import slo_for
from loadgen.traces import load_trace
from loadgen.workload import Workload
from services.cli.stack import Stack, StackSettings
from shared.latency import LatencyModel, load_profile
from tests.bench.sim_fidelity import METRICS, compare, first_token_deltas, misses, simulate_mix

pytestmark = pytest.mark.e2e

TRACE, START_S, DURATION_S, RATE_SCALE = "azure-conv", 1380.0, 40.0, 1.0
# Before and after the check, inside the benchmark's calibration slice (0-120 s).
CALIBRATION_SLICES = ((40.0, 15.0), (55.0, 15.0))


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
        def run(slice_: Workload, rate: float = 1.0) -> ReplayResult:
            return asyncio.run(replay(slice_, stack.gateway_url, model=settings.model, slo=slo, rate_scale=rate,
                                      timeout_s=120, api_key=stack.api_key))

        calibrations = [(before, run(before))]
        live = run(workload, RATE_SCALE).summary
        calibrations.append((after, run(after)))
    finally:
        stack.stop()
    # This host's serving-path delay, measured on the calibration slices (what overhead.py holds for the VM it
    # was calibrated on); the test slice is then predicted with it.
    deltas = [d for slice_, measured in calibrations
              for d in first_token_deltas(measured.records, simulate_mix(slice_, model, slo, delay=HANDSHAKE_ONLY).records)]
    host = FirstTokenDelay.fit(sorted(deltas), handshake_s=HANDSHAKE_S)
    sim = simulate_mix(workload, model, slo, RATE_SCALE, host).summary

    assert all(measured.summary.requests_failed == 0 for _, measured in calibrations)
    assert live.requests_total == len(workload.requests) == sim.requests_total
    assert live.requests_failed == 0 and sim.requests_failed == 0
    row = compare(live, sim)
    fixed = compare(live, simulate_mix(workload, model, slo, RATE_SCALE, LIVE_STACK_DELAY).summary)
    print(f"first-token delay on this host: median {host.median_s * 1e3:.1f} ms, p90 {host.p90_s * 1e3:.1f} ms "
          f"(overhead.py: {LIVE_STACK_DELAY.median_s * 1e3:.1f} / {LIVE_STACK_DELAY.p90_s * 1e3:.1f} ms)")
    for name, r in (("host delay", row), ("overhead.py delay", fixed)):
        print(name, {m: (round(r[m]["live_ms"], 2), round(r[m]["sim_ms"], 2), round(r[m]["error_pct"], 1))
                     for m in METRICS}, r["attainment"])
    problems = misses(row)
    assert not problems, (f"{TRACE} {START_S:g}-{START_S + DURATION_S:g} s x{RATE_SCALE:g}: live stack and simulator "
                          "disagree beyond the issue's bar:\n" + "\n".join(problems))
