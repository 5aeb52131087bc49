"""Replay a trace against a gateway and write the report: shared by ``poise run`` and ``poise bench``."""

from __future__ import annotations

import asyncio
import shlex
import sys
import time
from collections.abc import Callable
from pathlib import Path

from pydantic import Field

from loadgen.progress import print_progress
from loadgen.replay import ReplayResult, replay
from loadgen.report import format_table, write_report
from loadgen.slo import SLO, SLOClasses, slo_for
from loadgen.traces import load_trace
from loadgen.workload import Workload
from services.cli.stack import current_api_key
from shared.errors import PoiseError
from shared.protocol.refusal import CLIENT_MAX_RETRIES
from shared.settings import ServiceSettings


class TraceSliceSettings(ServiceSettings):
    """Which slice of which trace, at what rate, and where the report goes: what a live replay and the
    simulator share."""

    trace: str = Field("azure-conv", description="Trace: azure-code, azure-conv, mooncake-conv, mooncake-synthetic, a stress-set workload (stress-step, stress-ramp, stress-bursts, stress-mix-shift, stress-diurnal: loadgen/stress.py), a held-out workload (heldout-batch-waves, heldout-multi-tenant, heldout-week: loadgen/heldout.py, never tuned on), or a path to an Azure CSV / Mooncake JSONL file.")
    start_s: float = Field(0.0, ge=0.0, description="Where the slice starts in the trace, in seconds.")
    duration_s: float | None = Field(180.0, gt=0.0, description="Length of the slice in trace seconds (unset = to the end).")
    max_requests: int | None = Field(None, ge=1, description="Stop the slice after this many requests.")
    rate_scale: float = Field(1.0, gt=0.0, description="Request-rate multiplier: timestamps are divided by it (Arrow's method).")
    out_dir: Path | None = Field(None, description="Report directory (default .poise/results/<run>-<timestamp>).")


class ReplaySettings(TraceSliceSettings):
    """A trace slice sent to a gateway over HTTP."""

    endpoint: str = Field("completions", description="completions (token-id prompts, exact lengths) or chat (text prompts).")
    timeout_s: float = Field(600.0, description="Per-request timeout in seconds.")
    api_key: str | None = Field(None, description="Bearer API key for the gateway (default: the key of the stack `poise up` started here, when it is that stack's gateway).")
    client_retries: int = Field(CLIENT_MAX_RETRIES, ge=0, description="Times a refused request (429/503) is sent again, after Retry-After (else a backoff), as the openai client's max_retries; its TTFT counts from the first send; 0 = never.")


def select_workload(settings: TraceSliceSettings) -> Workload:
    try:
        workload = load_trace(settings.trace)
    except (FileNotFoundError, ValueError) as exc:  # an unknown name, or a file that is not a trace
        raise PoiseError(str(exc)) from None
    if settings.start_s == 0 and settings.duration_s is None and settings.max_requests is None:
        # The whole trace as the benchmarks load it: a slice re-bases on its first request, which would shift
        # every arrival of a trace that does not start at 0 (the stress set) and so the natural rate mode's draws.
        return workload
    return workload.slice(settings.start_s, settings.duration_s, settings.max_requests)


def run_replay(settings: ReplaySettings, *, gateway_url: str, model: str, title: str, label: str,
               classes: Callable[[SLO], SLOClasses | None] | None = None,
               extra: Callable[[ReplayResult, Path, SLO, SLOClasses | None], str | None] | None = None,
               slo: SLO | None = None) -> tuple[ReplayResult, Path]:
    """Replay the selected slice and write the report. ``classes(trace_slo)`` gives the SLO classes, if any:
    the requests are then labelled with them and judged by their class's SLO. ``extra(result, out_dir, slo,
    classes)``, called once the replay is done, may write more files into the report directory and return
    Markdown for the report, placed after the table (and printed after it)."""
    workload = select_workload(settings)
    slo = slo or slo_for(workload.name)
    slo_classes = classes(slo) if classes is not None else None
    if slo_classes is not None:
        workload = slo_classes.assign(workload)
        targets = f"SLO classes: {slo_classes.describe()}"
    else:
        targets = f"SLO: TTFT {slo.ttft_s:g}s, TPOT {slo.tpot_s:g}s"
    print(f"replaying {len(workload.requests)} requests of {workload.name} "
          f"({workload.duration_s:.0f}s of trace at {settings.rate_scale:g}x rate) against {gateway_url}; {targets}",
          file=sys.stderr)
    result = asyncio.run(replay(
        workload, gateway_url, model=model, endpoint=settings.endpoint, rate_scale=settings.rate_scale,  # type: ignore[arg-type]
        slo=slo, slo_classes=slo_classes, timeout_s=settings.timeout_s, client_retries=settings.client_retries,
        api_key=settings.api_key or current_api_key(gateway_url),  # `poise up`'s key, for its own gateway
        progress=print_progress,
    ))
    out = settings.out_dir or Path(".poise") / "results" / f"{label}-{time.strftime('%Y%m%d-%H%M%S')}"
    more = extra(result, out, slo, slo_classes) if extra is not None else None
    files = write_report(result, out, title=title, command=shlex.join(["poise", *sys.argv[1:]]), slo=slo,
                         classes=slo_classes, extra_markdown=more)
    print(format_table(result.summary, slo))
    if more:
        print("\n" + more.rstrip("\n"))
    print(f"\nreport: {files.md}  {files.json}  {files.png}")
    return result, out
