"""From an engine's load numbers to what a dispatcher sees: one path, live and simulated.

Live, an engine's ``/v1/loads`` is parsed into :class:`shared.engine_client.EngineLoads`, the sidecar publishes
it as a :class:`LoadReport` (:func:`load_report`) and the gateway turns the latest report, with its own
in-flight ledger, into the :class:`EngineView` its policies read (:func:`engine_view`). The simulator's engines
compute their numbers with the engine model's function (``shared.engine.load``, engine_sim's too), convert them
as ``/v1/loads`` would parse (:func:`engine_loads`) and take the same two steps, so the simulated dispatcher
reads every field by the live rule.
"""

from __future__ import annotations

from shared.engine.load import EngineLoad
from shared.engine_client import EngineLoads
from shared.policies.inflight import Inflight
from shared.policies.views import EngineView
from shared.protocol import LoadReport
from shared.protocol.messages import InstanceStatus, Role


def engine_loads(load: EngineLoad, *, mode: Role, kv_capacity_tokens: int, max_running_requests: int,
                 gen_throughput_tps: float, snapshot_unix_s: float | None = None) -> EngineLoads:
    """``load`` as :func:`shared.engine_client.parse_loads` reads an engine's ``/v1/loads`` reporting it (one DP
    rank; engine_sim renders the same numbers: services/engine_sim/reports.py)."""
    return EngineLoads(
        dp_ranks=1, num_running_reqs=load.running_reqs, num_waiting_reqs=load.waiting_reqs,
        num_waiting_uncached_tokens=load.uncached_tokens, num_used_tokens=load.used_tokens,
        max_total_num_tokens=kv_capacity_tokens, max_running_requests=max_running_requests,
        token_usage=load.used_tokens / kv_capacity_tokens if kv_capacity_tokens > 0 else 0.0,
        gen_throughput_tps=gen_throughput_tps, mode=mode,
        prefill_bootstrap_queue_reqs=load.bootstrap_reqs, prefill_inflight_queue_reqs=load.inflight_reqs,
        decode_prealloc_queue_reqs=load.prealloc_reqs, decode_transfer_queue_reqs=load.transfer_reqs,
        decode_retracted_queue_reqs=load.retracted_reqs, running_tokens=load.running_tokens,
        snapshot_unix_s=snapshot_unix_s)


def load_report(instance_id: str, role: Role, status: InstanceStatus, loads: EngineLoads, ts_unix_s: float,
                after_seq: int = 0) -> LoadReport:
    """A :class:`LoadReport` from one ``/v1/loads`` reading, with the prefill samples newer than ``after_seq``."""
    return LoadReport(
        instance_id=instance_id, role=role, status=status, ts_unix_s=ts_unix_s, healthy=True,
        num_running_reqs=loads.num_running_reqs, num_waiting_reqs=loads.num_waiting_reqs,
        num_waiting_uncached_tokens=loads.num_waiting_uncached_tokens, num_used_tokens=loads.num_used_tokens,
        num_running_tokens=loads.running_tokens,
        max_total_num_tokens=loads.max_total_num_tokens, token_usage=loads.token_usage,
        gen_throughput_tps=loads.gen_throughput_tps, prefill_queue_reqs=loads.prefill_queue_reqs,
        prefill_bootstrap_reqs=loads.prefill_bootstrap_queue_reqs,
        decode_queue_reqs=loads.decode_queue_reqs,
        decode_kv_waiting_reqs=loads.decode_prealloc_queue_reqs + loads.decode_retracted_queue_reqs,
        prefill_samples=[(tokens, seconds) for seq, tokens, seconds in loads.prefill_samples if seq > after_seq],
    )


def engine_view(instance_id: str, role: Role, status: InstanceStatus, *, kv_capacity_tokens: int,
                max_running_requests: int, load: LoadReport | None, load_age_s: float | None, held: Inflight,
                finish_rate_rps: float | None, local_prefill: bool) -> EngineView:
    """What a dispatcher sees of one engine: its registration, its latest load report (None: none yet; then
    only the dispatcher's own in-flight work, ``held``, counts) and how many requests it finished lately."""
    if load is None:
        return EngineView(
            instance_id=instance_id, role=role, status=status,
            kv_capacity_tokens=kv_capacity_tokens, max_running_requests=max_running_requests,
            inflight_reqs=held.reqs, inflight_tokens=held.tokens, inflight_tokens_sq=held.tokens_sq,
            local_prefill=local_prefill)
    return EngineView(
        instance_id=instance_id, role=role, status=status, healthy=load.healthy,
        kv_capacity_tokens=kv_capacity_tokens, max_running_requests=max_running_requests,
        running_reqs=load.num_running_reqs, waiting_reqs=load.num_waiting_reqs, used_tokens=load.num_used_tokens,
        queue_reqs=load.prefill_queue_reqs + load.decode_queue_reqs, load_age_s=load_age_s,
        kv_waiting_reqs=load.decode_kv_waiting_reqs,
        inflight_reqs=held.reqs, inflight_tokens=held.tokens, inflight_tokens_sq=held.tokens_sq,
        token_interval_s=token_interval(load), finish_rate_rps=finish_rate_rps, local_prefill=local_prefill)


def token_interval(load: LoadReport) -> float | None:
    """Recent time between tokens of a decode engine: its running requests over its generation throughput."""
    if load.num_running_reqs <= 0 or load.gen_throughput_tps <= 0:
        return None
    return load.num_running_reqs / load.gen_throughput_tps
