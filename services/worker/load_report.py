"""What the sidecar publishes from one ``/v1/loads`` reading, and how it tells a hung engine from a busy one."""

from __future__ import annotations

from shared.engine_client import EngineLoads
from shared.protocol import LoadReport
from shared.protocol.messages import InstanceStatus, Role


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


class SampleCursor:
    """The newest engine prefill sample already published, so each goes out once; an engine that restarted
    numbers its samples from the start again."""

    __slots__ = ("seq",)

    def __init__(self) -> None:
        self.seq = 0

    def report(self, instance_id: str, role: Role, status: InstanceStatus, loads: EngineLoads,
               ts_unix_s: float) -> LoadReport:
        seqs = [seq for seq, _, _ in loads.prefill_samples]
        if seqs and max(seqs) < self.seq:
            self.seq = 0
        report = load_report(instance_id, role, status, loads, ts_unix_s, self.seq)
        if seqs:
            self.seq = max(seqs)
        return report


def hung_for(loads: EngineLoads, now_unix_s: float, stalled_after_s: float) -> float | None:
    """How long the engine's scheduler has been stuck with work, once past ``stalled_after_s``; else None.
    Its /v1/loads keeps answering from the last snapshot, so only the snapshot's age shows it."""
    if loads.busy_snapshot_unix_s is None:
        return None
    age = now_unix_s - loads.busy_snapshot_unix_s
    return age if age > stalled_after_s else None
