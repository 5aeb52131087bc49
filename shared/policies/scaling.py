"""Scaling policies: how many prefill and decode replicas to run (Dynamo's planners and DOPD's).

A policy is pure: ``decide(snapshot, now_s)`` reads a :class:`ClusterSnapshot` and returns a
:class:`ScalingTarget` (replica counts per role) or ``None`` for "no opinion". Whoever executes it starts
and stops engines to reach the counts: the simulator with a start-up cost, the live planner through a
connector (services/planner/connectors.py). Scaling never flips a role; flips are the pool policies' business (``pools.py``).

The two Dynamo baselines follow ../shared/anchors.md §2.3. Where Dynamo learns a performance model
(profiler data, online regressions of forward-pass metrics), these read the same latency profile the
engines run on: the profile *is* the profiled data here, so the baselines get a perfect performance model,
which favours them, not us.

Imports nothing from asyncio, nats, aetcd, httpx or fastapi.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from typing import Protocol

import msgspec

from shared.latency import LatencyModel
from shared.policies.context import PolicyContext
from shared.policies.report import PolicyReport
from shared.protocol.messages import ClusterSnapshot, InstanceLoad, Role, SeriesPoint


class ScalingTarget(msgspec.Struct, frozen=True, kw_only=True):
    """Wanted replica counts. ``reason`` ends up in logs and in the simulator's timeline."""

    prefill: int
    decode: int
    reason: str


class ScalingPolicy(Protocol):
    name: str
    note: str
    interval_s: float  # how often the executor asks

    def decide(self, snapshot: ClusterSnapshot, now_s: float) -> ScalingTarget | None: ...

    def report(self) -> PolicyReport:
        """What it last decided and why (the planner reads it between decisions)."""
        ...


def active(snapshot: ClusterSnapshot, role: Role) -> list[InstanceLoad]:
    """Instances of ``role`` that count as replicas: ready or starting (draining ones are on their way out)."""
    return [i for i in snapshot.instances if i.info.role == role and i.info.status in ("ready", "starting")]


def fit_budget(prefill: int, decode: int, ctx: PolicyContext) -> tuple[int, int]:
    """Clamp to [min_per_role, budget]; over budget, shrink both in proportion (Dynamo's max_gpu_budget)."""
    prefill, decode = max(prefill, ctx.min_per_role), max(decode, ctx.min_per_role)
    total = prefill + decode
    if total <= ctx.max_instances:
        return prefill, decode
    p = max(ctx.min_per_role, min(ctx.max_instances - ctx.min_per_role, round(ctx.max_instances * prefill / total)))
    return p, ctx.max_instances - p


class DynamoLoadParams(msgspec.Struct, frozen=True, kw_only=True):
    interval_s: float = 5.0  # Dynamo's load-based adjustment interval
    scale_down_sensitivity: float = 0.5  # scale down when every engine's estimate is below SLO x this (ours)


class DynamoLoad:
    """Dynamo's load-based (reactive) planner: ±1 replica per role per interval.

    For every prefill engine it estimates the TTFT a new request would see (queued prompt tokens plus one
    average prompt through the prefill model); for every decode engine the ITL of its next step (running
    requests and their KV). If *all* engines of a role are over the SLO it adds one; if all are under
    SLO x sensitivity it removes one.
    """

    name = "dynamo-load"
    note = "dynamo-load: reactive ±1 replica per role when all engines' estimated TTFT/ITL cross the SLO"

    def __init__(self, model: LatencyModel, ctx: PolicyContext, params: DynamoLoadParams | None = None) -> None:
        self.model, self.ctx, self.params = model, ctx, params or DynamoLoadParams()
        self.interval_s = self.params.interval_s

    def report(self) -> PolicyReport:
        return PolicyReport()  # it keeps no target or forecast between intervals

    def decide(self, snapshot: ClusterSnapshot, now_s: float) -> ScalingTarget | None:
        prefills = [i for i in active(snapshot, "prefill") if i.load is not None and i.info.status == "ready"]
        decodes = [i for i in active(snapshot, "decode") if i.load is not None and i.info.status == "ready"]
        n_p, n_d = len(active(snapshot, "prefill")), len(active(snapshot, "decode"))
        if not prefills or not decodes or not snapshot.series:
            return None  # no engine of a role ready yet, or no traffic observed yet: nothing to react to
        isl = _latest_mean(snapshot.series, "mean_input_tokens") or 1024.0
        ttfts = [self.model.prefill_time_s(int(i.load.num_waiting_uncached_tokens + isl)) for i in prefills if i.load]
        itls = [self.model.decode_step_time_s(i.load.num_running_reqs + 1, i.load.num_used_tokens)
                for i in decodes if i.load]
        dp = self._step(ttfts, self.ctx.ttft_slo_s)
        dd = self._step(itls, self.ctx.tpot_slo_s)
        if dp == 0 and dd == 0:
            return None
        prefill = max(self.ctx.min_per_role, n_p + dp)
        decode = max(self.ctx.min_per_role, n_d + dd)
        if prefill + decode > self.ctx.max_instances and dp > 0 and dd > 0:
            # One GPU left for two wants: the role further over its SLO gets it.
            if min(ttfts) / self.ctx.ttft_slo_s >= min(itls) / self.ctx.tpot_slo_s:
                decode -= 1
            else:
                prefill -= 1
        if prefill + decode > self.ctx.max_instances or (prefill, decode) == (n_p, n_d):
            return None
        return ScalingTarget(prefill=prefill, decode=decode,
                             reason=f"load: est TTFT max {max(ttfts) * 1e3:.0f} ms, ITL max {max(itls) * 1e3:.1f} ms")

    def _step(self, estimates: Sequence[float], slo: float) -> int:
        if all(e > slo for e in estimates):
            return 1
        if all(e < slo * self.params.scale_down_sensitivity for e in estimates):
            return -1
        return 0


class DynamoSlaParams(msgspec.Struct, frozen=True, kw_only=True):
    interval_s: float = 180.0  # Dynamo's throughput_adjustment_interval_seconds default


class DynamoSla:
    """Dynamo's throughput-based (SLA) planner with the ``constant`` load predictor.

    Every interval: demand = last interval's request rate, mean ISL and OSL (Dynamo's default predictor is
    ARIMA; the ``constant`` one is used until DOPD's forecaster lands in this package). Per-engine capacity
    under the SLA comes from the profile: prefill tokens/s at that ISL; decode tokens/s at the largest batch
    whose step time meets the TPOT SLO at context ISL + OSL/2 and whose KV fits. Then
    ``num_p = ceil(prompt tokens/s / prefill capacity)`` and ``num_d = ceil(output tokens/s / decode
    capacity)``, clamped to the GPU budget.
    """

    name = "dynamo-sla"
    note = "dynamo-sla: replicas from last interval's rate, ISL, OSL and the profile's per-engine capacity"

    def __init__(self, model: LatencyModel, ctx: PolicyContext, params: DynamoSlaParams | None = None) -> None:
        self.model, self.ctx, self.params = model, ctx, params or DynamoSlaParams()
        self.interval_s = self.params.interval_s

    def report(self) -> PolicyReport:
        return PolicyReport()  # it keeps no target or forecast between intervals

    def decide(self, snapshot: ClusterSnapshot, now_s: float) -> ScalingTarget | None:
        window = _window(snapshot.series, self.interval_s)
        span = sum(p.interval_s for p in window)
        completed = sum(p.completed for p in window)
        if span <= 0 or completed == 0:
            return None
        rate = sum(p.arrivals for p in window) / span
        isl = sum(p.mean_input_tokens * p.completed for p in window) / completed
        osl = sum(p.mean_output_tokens * p.completed for p in window) / completed
        prefill_tps = self.prefill_capacity_tps(isl)
        decode_tps = self.decode_capacity_tps(isl, osl)
        prefill = math.ceil(rate * isl / prefill_tps) if prefill_tps > 0 else self.ctx.max_instances
        decode = math.ceil(rate * osl / decode_tps) if decode_tps > 0 else self.ctx.max_instances
        prefill, decode = fit_budget(prefill, decode, self.ctx)
        return ScalingTarget(prefill=prefill, decode=decode,
                             reason=f"sla: {rate:.2f} req/s, ISL {isl:.0f}, OSL {osl:.0f}")

    def prefill_capacity_tps(self, isl: float) -> float:
        length = max(1, int(isl))
        return length / self.model.prefill_time_s(length)

    def decode_capacity_tps(self, isl: float, osl: float) -> float:
        p = self.model.profile
        context = max(1.0, isl + osl / 2)
        by_kv = int(p.kv_capacity_tokens // max(1.0, isl + osl))
        best = 0.0
        for batch in range(1, min(p.max_running_requests, max(by_kv, 1)) + 1):
            step = self.model.decode_step_time_s(batch, int(batch * context))
            if step > self.ctx.tpot_slo_s:
                break
            best = batch / step
        return best


def _latest_mean(series: Sequence[SeriesPoint], field: str) -> float | None:
    for point in reversed(series):
        if point.completed:
            return float(getattr(point, field))
    return None


def _window(series: Sequence[SeriesPoint], span_s: float) -> list[SeriesPoint]:
    """The newest points covering ``span_s`` seconds."""
    out: list[SeriesPoint] = []
    covered = 0.0
    for point in reversed(series):
        if covered >= span_s:
            break
        out.append(point)
        covered += point.interval_s
    return out


def pick_retiree(snapshot: ClusterSnapshot, role: Role, exclude: Iterable[str] = ()) -> str | None:
    """The instance of ``role`` to retire on scale-in: one still starting, else the least loaded ready one.

    A starting instance serves nothing yet, so stopping it costs no capacity and no drain. Load = running +
    waiting requests, then KV tokens in use; an instance with no load sample yet counts as empty. Draining or
    switching instances are already on their way, and ``exclude`` (being retired already) is skipped. The
    simulator and the live resizer both use this rule.
    """
    skip = set(exclude)
    candidates = [i for i in snapshot.instances if i.info.role == role and i.info.status in ("ready", "starting")
                  and i.info.instance_id not in skip]
    if not candidates:
        return None

    def load_key(inst: InstanceLoad) -> tuple[bool, int, int, str]:
        serving = inst.info.status != "starting"
        load = inst.load
        if load is None:
            return (serving, 0, 0, inst.info.instance_id)
        return (serving, load.num_running_reqs + load.num_waiting_reqs, load.num_used_tokens, inst.info.instance_id)

    return min(candidates, key=load_key).info.instance_id
