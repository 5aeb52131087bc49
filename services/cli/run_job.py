"""``poise run``, the main job: its defaults, and the split-over-time comparison its report gets.

By default the main job replays a slice of the stress workload ``stress-mix-shift`` (loadgen/stress.py)
whose prompts grow from Azure conversation's to Azure code's at a constant request rate, so the best P:D
split moves while it runs and the ``poise`` planner (the default) flips an instance to prefill within the
first minute. The slice (trace seconds 720-1800: from two minutes into the 10-minute length blend through the
rest of it and the 10 code-only minutes) is replayed 6x faster, timestamps divided by 6 (Arrow's method:
`ReplaySettings.rate_scale`): three minutes of wall time on 2P+2D engine_sim, at a rate where the split
matters on 4 instances. The slice was picked in the simulator to show the controller act; the stress set is
held out from tuning the controller, and nothing here tunes it. README ("The two commands") has a run's
numbers.

While the replay runs, `SplitWatcher` records the live split; afterwards the same slice goes through the
simulator (`loadgen.split_compare`) and the report gets ``split.png`` (attainment over time, live and
simulated, above the split over time) and a line with each run's attainment.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from pydantic import Field, model_validator

from loadgen.replay import ReplayResult
from loadgen.slo import SLO, SLOClasses
from services.cli.main import RunSettings, slo_classes
from services.cli.replay_job import run_replay, select_workload
from services.cli.split_watch import SplitWatcher
from services.cli.stack import Stack

#: The main job's slice: stress-mix-shift from trace second 720 (the length blend is 12% code prompts
#: there) to its end at 1800 s, 6x compressed: 180 s of wall time.
MAIN_JOB_TRACE = "stress-mix-shift"
MAIN_JOB_START_S = 720.0
MAIN_JOB_DURATION_S = 1080.0
MAIN_JOB_RATE_SCALE = 6.0


class MainJobSettings(RunSettings):
    """Bring the dev stack up, replay a slice whose load shifts, report (with the P:D split over time next to
    what the simulator says a fixed split would have done), and shut down."""

    trace: str = Field(MAIN_JOB_TRACE, description="Trace: a stress-set workload (stress-mix-shift, the default: prompts grow from Azure conversation's to Azure code's at a constant rate, so the best P:D split moves; stress-step, stress-ramp, stress-bursts, stress-diurnal; loadgen/stress.py), azure-code, azure-conv, mooncake-conv, mooncake-synthetic, or a path to an Azure CSV / Mooncake JSONL file. Without --trace the slice is the main job's (--start-s 720 --duration-s 1080 --rate-scale 6); with it, the defaults below.")
    start_s: float = Field(0.0, ge=0.0, description="Where the slice starts in the trace, in trace seconds (without --trace: 720).")
    duration_s: float | None = Field(180.0, gt=0.0, description="Length of the slice in trace seconds (unset = to the end; without --trace: 1080).")
    rate_scale: float = Field(1.0, gt=0.0, description="Request-rate multiplier of this live replay (without --trace: 6): timestamps are divided by it (Arrow's method; the slice's trace seconds pass this many times faster, so a length mix shifts faster too). This is `poise sim --rate-mode compress`, not its natural mode; the report's simulated comparison uses compress to match.")
    pace: bool = Field(True, description="Sample how many other tasks want a core before the stack comes up and, on a busy machine, replay at a rate cut in proportion to the cores left (at least a quarter of --rate-scale), saying so; --no-pace replays at --rate-scale whatever else runs.")
    compare: bool = Field(True, description="Record the live P:D split during the replay and simulate the same slice (the poise mix, that mix at the fixed starting split, static-minload at it) for the report's split.png and its comparison line; --no-compare skips both.")

    @model_validator(mode="before")
    @classmethod
    def _main_job_slice(cls, data: Any) -> Any:
        """No --trace (flag or env): the main job's slice, for whichever of start, duration and scale are unset."""
        if not isinstance(data, dict) or data.get("trace") is not None:
            return data
        return {"start_s": MAIN_JOB_START_S, "duration_s": MAIN_JOB_DURATION_S, "rate_scale": MAIN_JOB_RATE_SCALE,
                **data}


def simulated_poise_overrides(settings: RunSettings) -> dict[str, object]:
    """``make_mix`` keywords that make the simulator's ``poise`` mix run what this stack ran: its engines'
    policies, the gateway's early rejection and late binding, the migrator's policy."""
    chunk = settings.chunked_prefill_size
    engine: dict[str, object] = {
        "prefill_policy": settings.prefill_policy, "preemption": settings.preemption,
        "chunk_tokens": None if chunk is None else max(chunk, 0), "decode_policy": settings.decode_policy,
        "early_rejection": settings.early_rejection, "give_up_late": settings.give_up_late_prompts,
        "late_binding": settings.late_binding_policy if settings.late_binding else "none",
        "late_binding_depth": settings.late_binding_depth}
    if settings.migration_policy != "none":
        engine |= {"migration": settings.migration_policy, "migration_mechanism": settings.migration_mechanism}
    return engine


def _comparison_hook(settings: MainJobSettings, watcher: SplitWatcher | None,
                     ) -> Callable[[ReplayResult, Path, SLO, SLOClasses | None], str | None]:
    """The `run_replay` hook: stop the watcher, simulate the slice, write split.{png,json}, return the Markdown."""
    from loadgen.split_compare import (
        LiveSplit,
        comparison_mixes,
        live_restart_s,
        simulate_comparison,
        write_split_comparison,
    )

    def extra(result: ReplayResult, out: Path, slo: SLO, classes: SLOClasses | None) -> str | None:
        try:
            return comparison(result, out, slo, classes)
        except Exception as exc:  # the live report is written whatever happens to the comparison
            print(f"warning: no split comparison ({type(exc).__name__}: {exc})", file=sys.stderr)
            return None

    def comparison(result: ReplayResult, out: Path, slo: SLO, classes: SLOClasses | None) -> str:
        live_split = None
        if watcher is not None:
            watcher.stop()
            if watcher.samples:
                live_split = LiveSplit.from_unix(watcher.samples, watcher.events, result.started_at,
                                                 watcher.decision_latency)
            else:
                print(f"warning: the live split was not recorded ({watcher.error or 'no snapshot answered'})",
                      file=sys.stderr)
        sims = []
        if settings.colocated == 0:
            split = f"{settings.prefill}P{settings.decode}D"
            engine: dict[str, object] = {}
            local = None
            if settings.planner_policy == "poise":  # the poise mix as this stack ran it; else the mix's defaults
                engine = simulated_poise_overrides(settings)
                local = settings.local_prefill_tokens()
            workload = select_workload(settings)
            if classes is not None:
                workload = classes.assign(workload)
            # engine_sim restarts in seconds, SGLang in tens: the simulation charges what the live restarts took.
            restart_s = live_restart_s(watcher.events) if watcher is not None else None
            print(f"simulating the same slice for the comparison ({split}: poise, fixed, static-minload"
                  + (f"; engine restarts {restart_s:.1f} s as live" if restart_s is not None else "") + ")",
                  file=sys.stderr)
            sims = simulate_comparison(
                workload, comparison_mixes(settings.prefill + settings.decode, split,
                                           engine={k: v for k, v in engine.items() if v is not None},
                                           local_prefill_tokens=local),
                profile=settings.profile, slo=slo, rate_scale=settings.rate_scale, classes=classes,
                restart_s=restart_s, client_retries=settings.client_retries)
        title = f"{settings.trace} at {settings.rate_scale:g}x: planner {settings.planner_policy} live vs simulated"
        return write_split_comparison(out, result, live_split, sims, slo, title=title, rate_scale=settings.rate_scale,
                                      classes=classes)

    return extra


def run_main_job(settings: MainJobSettings, stack: Stack, title: str) -> ReplayResult:
    """Replay against ``stack``; with ``settings.compare``, record the split and add the comparison."""
    watcher = None
    if settings.compare:
        watcher = SplitWatcher.for_stack(stack)
        watcher.start()
    try:
        return run_replay(settings, gateway_url=stack.gateway_url, model=settings.model, title=title, label="run",
                          classes=lambda trace_slo: slo_classes(settings, trace_slo), slo=SLO(*settings.planning_slo()),
                          extra=_comparison_hook(settings, watcher) if settings.compare else None)[0]
    finally:
        if watcher is not None:
            watcher.stop()
