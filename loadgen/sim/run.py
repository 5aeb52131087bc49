"""Run one trace through one policy mix in virtual time; results come back as a ReplayResult."""

from __future__ import annotations

import functools
import time
from datetime import UTC, datetime

from loadgen.metrics import summarize
from loadgen.records import RequestRecord
from loadgen.replay import ReplayResult
from loadgen.sim.baselines import PolicyMix
from loadgen.sim.cluster import SimCluster, SimRequest
from loadgen.sim.events import PRIORITY_ARRIVAL, EventQueue
from loadgen.sim.overhead import LIVE_STACK_DELAY, FirstTokenDelay
from loadgen.slo import SLO
from loadgen.workload import Workload
from shared.latency import LatencyModel


def simulate(workload: Workload, mix: PolicyMix, model: LatencyModel, slo: SLO, *, rate_scale: float = 1.0,
             first_token_delay: FirstTokenDelay = LIVE_STACK_DELAY) -> ReplayResult:
    """Replay ``workload`` (timestamps divided by ``rate_scale``) against ``mix``; deterministic.

    ``first_token_delay`` is the serving path's handoff delay (default: calibrated on the live stack;
    ``NO_DELAY`` for the bare latency model).
    """
    queue = EventQueue()
    cluster = SimCluster(mix.roles, model, mix.dispatch, queue, first_token_delay)
    scaled = workload.scale_rate(rate_scale)
    requests = [SimRequest(index=r.index, rid=f"sim-{r.index}", arrival_s=r.arrival_s, input_tokens=r.input_tokens,
                           output_tokens=max(1, r.output_tokens)) for r in scaled.requests]
    for req in requests:
        queue.at(req.arrival_s, PRIORITY_ARRIVAL, functools.partial(cluster.submit, req))
    wall0 = time.perf_counter()
    queue.run()
    wall = time.perf_counter() - wall0
    records = [_record(r) for r in requests]
    makespan = max((r.finished_s for r in records), default=0.0)
    config = {
        "simulated": True, "trace": workload.name, "policy": mix.name, "description": mix.description,
        "roles": mix.roles, "profile": model.profile.name,
        "first_token_delay_ms": {"median": first_token_delay.median_s * 1e3, "p90": first_token_delay.p90_s * 1e3}, "rate_scale": rate_scale, "requests": len(records),
        "events": queue.processed, "sim_wall_s": wall,
        "sim_seconds_per_wall_second": makespan / wall if wall > 0 else None,
    }
    return ReplayResult(records=records, summary=summarize(records, slo, makespan), wall_s=makespan,
                        started_at=datetime.now(UTC).isoformat(), config=config)


def _record(req: SimRequest) -> RequestRecord:
    assert req.finished_s is not None, f"request {req.rid} never finished: the simulation lost it"
    return RequestRecord(
        index=req.index, rid=req.rid, arrival_s=req.arrival_s, sent_s=req.arrival_s, first_token_s=req.first_token_s,
        finished_s=req.finished_s, input_tokens=req.input_tokens, output_tokens_expected=req.output_tokens,
        output_tokens_received=req.generated, status="error" if req.error else "ok", error=req.error,
    )
