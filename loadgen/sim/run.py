"""Run one trace through one policy mix in virtual time; results come back as a ReplayResult."""

from __future__ import annotations

import dataclasses
import functools
import math
import time
from datetime import UTC, datetime

import msgspec

from loadgen.metrics import summarize
from loadgen.rate_scaling import RateMode, scale_load
from loadgen.records import RequestRecord
from loadgen.replay import ReplayResult, after_warmup
from loadgen.sim.baselines import PolicyMix
from loadgen.sim.cluster import SimCluster, SimCosts, lifecycle_json
from loadgen.sim.control import ControlLoop, ControlParams
from loadgen.sim.events import PRIORITY_ARRIVAL, EventQueue
from loadgen.sim.instance import SimRequest
from loadgen.sim.overhead import LIVE_STACK_DELAY, FirstTokenDelay
from loadgen.slo import SLO, SLOClasses
from loadgen.workload import Workload
from shared.latency import LatencyModel
from shared.policies import PolicyContext, make_prefill_policy, with_gateway_rules
from shared.policies.late_binding import LateBinding
from shared.policies.migration_cost import make_migration_mechanism


def simulate(workload: Workload, mix: PolicyMix, model: LatencyModel, slo: SLO, *, rate_scale: float = 1.0,
             first_token_delay: FirstTokenDelay = LIVE_STACK_DELAY, slo_classes: SLOClasses | None = None,
             costs: SimCosts | None = None, control: ControlParams | None = None,
             rate_mode: RateMode = "compress", warmup_s: float = 0.0, seed: int = 0,
             client_retries: int = 0) -> ReplayResult:
    """Replay ``workload`` at ``rate_scale`` times its rate against ``mix``; deterministic.

    ``rate_mode`` says how the rate is raised (``loadgen.rate_scaling``: ``natural`` keeps the trace's clock,
    ``compress`` divides the timestamps, Arrow's method); ``seed`` draws the natural mode's added arrivals.
    Requests arriving in the first ``warmup_s`` simulated seconds are served but left out of the summary
    (every record is still returned).

    ``first_token_delay`` is the serving path's handoff delay (default: calibrated on the live stack;
    ``NO_DELAY`` for the bare latency model). With ``slo_classes``, each request gets its class's SLO
    (policies see it) and the summary judges it by that SLO; requests the workload already labelled keep
    their class. ``client_retries``: clients send a refused request (429/503) again after the gateway's
    Retry-After, up to this many times (shared/protocol/refusal.py), and its TTFT counts from the first send.
    """
    queue = EventQueue()
    budget = mix.max_instances or len(mix.roles)
    drains = mix.migration_mechanism if mix.drain_by_migration else None
    mix = mix.bound(model, PolicyContext(ttft_slo_s=slo.ttft_s, tpot_slo_s=slo.tpot_s, max_instances=budget,
                                         drain_migration=drains))
    mix = dataclasses.replace(mix, dispatch=with_gateway_rules(mix.dispatch, slo.ttft_s, mix.local_prefill,
                                                               mix.early_rejection))
    late = None
    if mix.late_binding is not None:
        late = LateBinding(make_prefill_policy(mix.late_binding[0], model), depth=mix.late_binding[1],
                           guard_decode=mix.early_rejection is not None)
    cluster = SimCluster(mix.roles, model, mix.dispatch, queue, first_token_delay, engine=mix.engine, late_binding=late,
                         costs=costs, max_instances=budget, handshake_s=first_token_delay.handshake_s,
                         mechanism=make_migration_mechanism(mix.migration_mechanism, model),
                         drain_by_migration=mix.drain_by_migration, client_retries=client_retries)
    scaled = scale_load(workload, rate_scale, rate_mode, seed=seed)
    if slo_classes is not None:
        scaled = Workload(name=scaled.name, requests=[
            r if r.slo_class is not None else msgspec.structs.replace(r, slo_class=slo_classes.class_for(r.index))
            for r in scaled.requests])
    requests = []
    for r in scaled.requests:
        target = slo_classes.slo_of(r.slo_class) if slo_classes is not None and r.slo_class is not None else slo
        requests.append(SimRequest(index=r.index, rid=f"sim-{r.index}", arrival_s=r.arrival_s,
                                   input_tokens=r.input_tokens, output_tokens=max(1, r.output_tokens),
                                   slo_ttft_s=target.ttft_s, slo_tpot_s=target.tpot_s, slo_class=r.slo_class,
                                   blocks=r.hash_ids))
    queue.preload(((req.arrival_s, functools.partial(cluster.submit, req)) for req in requests), PRIORITY_ARRIVAL)
    loop = None
    observe = getattr(mix.dispatch, "observe_prefill", None)
    if observe is not None:
        cluster.observe_prefill(observe)
    if mix.controlled:
        loop = ControlLoop(cluster, queue, total_requests=len(requests), profile_name=model.profile.name,
                           scaling=mix.scaling, pools=mix.pools, migration=mix.migration, length=mix.length,
                           params=control)
        loop.start()
    wall0 = time.perf_counter()
    queue.run()
    wall = time.perf_counter() - wall0
    records = [_record(r) for r in requests]
    makespan = max((r.finished_s for r in records), default=0.0)
    cluster.close(until_s=makespan)
    config = {
        "simulated": True, "trace": workload.name, "policy": mix.name, "description": mix.description,
        "roles": mix.roles, "profile": model.profile.name,
        "policies": {"dispatch": mix.dispatch.name, "scaling": getattr(mix.scaling, "name", None), "pools": getattr(mix.pools, "name", None),
                     "migration": getattr(mix.migration, "name", None), "migration_mechanism": mix.migration_mechanism,
                     "prefill": mix.engine.prefill_policy,
                     "preemption": mix.engine.preemption, "chunk_tokens": mix.engine.chunk_tokens,
                     "decode_batch": mix.engine.decode_policy, "length": mix.length.name,
                     "late_binding": list(mix.late_binding) if mix.late_binding else None},
        "preemptions": _preemptions(cluster),
        # decode requests parked for lack of KV (EngineSpec.decode_kv "grow"; always 0 with "whole")
        "retractions": sum(i.retractions for i in cluster.instances.values()),
        "local_prefills": cluster.decisions["local-prefill"],
        # refused at dispatch, held in the gateway past the target, or waiting on a colocated engine past it
        "early_rejections": (cluster.decisions["slo_unreachable"] + cluster.given_up
                             + sum(i.given_up for i in cluster.instances.values())),
        "prefix_cache": _cache_summary(requests) if mix.engine.prefix_cache else None,
        "first_token_delay_ms": {"median": first_token_delay.median_s * 1e3, "p90": first_token_delay.p90_s * 1e3,
                                 "handshake": first_token_delay.handshake_s * 1e3},
        "client_retries": client_retries, "retries": cluster.retries,
        "rate_scale": rate_scale, "rate_mode": rate_mode, "warmup_s": warmup_s, "requests": len(records), "events": queue.processed, "sim_wall_s": wall,
        "sim_seconds_per_wall_second": makespan / wall if wall > 0 else None,
        "slo_classes": slo_classes.specs if slo_classes is not None else [],
        "lifecycle": lifecycle_json(cluster.lifecycle),
        "decisions": [list(d) for d in loop.decisions] if loop is not None else [],
        "decode_balance": loop.balance.summary() if loop is not None else None,
        "engine_forecast_isl": [list(x) for x in loop.relayed_isl] if loop is not None else [],
    }
    counted, span = after_warmup(records, makespan, warmup_s)
    return ReplayResult(records=records, summary=summarize(counted, slo, span, slo_classes), wall_s=makespan,
                        started_at=datetime.now(UTC).isoformat(), config=config)


def _preemptions(cluster: SimCluster) -> dict[str, float | int | None]:
    """Operator-level cuts across the cluster and how long the preempting prompt waited for the boundary."""
    blocking = sorted(b for i in cluster.instances.values() for b in i.preemptions.blocking_s)
    if not blocking:
        return {"count": 0, "blocking_ms_p50": None, "blocking_ms_max": None}
    return {"count": len(blocking), "blocking_ms_p50": blocking[len(blocking) // 2] * 1e3,
            "blocking_ms_max": blocking[-1] * 1e3}


def _cache_summary(requests: list[SimRequest]) -> dict[str, float | int]:
    """The prefix cache's hit rate over the run: cached prompt tokens over all prompt tokens."""
    prompt = sum(r.input_tokens for r in requests)
    cached = sum(r.cached for r in requests)
    return {"prompt_tokens": prompt, "cached_tokens": cached, "hit_rate": cached / prompt if prompt else 0.0}


def _record(req: SimRequest) -> RequestRecord:
    assert req.finished_s is not None, f"request {req.rid} never finished: the simulation lost it"
    first = req.arrival_s if math.isnan(req.first_arrival_s) else req.first_arrival_s
    return RequestRecord(
        # A retried request is judged from its first send, as its client counts the wait.
        index=req.index, rid=req.rid, arrival_s=first, sent_s=first, first_token_s=req.first_token_s,
        finished_s=req.finished_s, input_tokens=req.input_tokens, output_tokens_expected=req.output_tokens,
        output_tokens_received=req.generated, status="error" if req.error else "ok", error=req.error,
        http_status=req.http_status, attempts=req.attempts,
        slo_class=req.slo_class, cached_tokens=req.cached,
    )
