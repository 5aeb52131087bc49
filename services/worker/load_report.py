"""What the sidecar publishes from each ``/v1/loads`` reading (``shared.load_view.load_report``, each prefill sample
once), and how it tells a hung engine from a busy one."""

from __future__ import annotations

from shared.engine_client import EngineLoads
from shared.load_view import load_report
from shared.protocol import LoadReport
from shared.protocol.messages import InstanceStatus, Role


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
