"""The scheduler's per-phase queues: where each live request sits, by its ``Phase``.

One container, so that the engine, batching.py, transfer.py and reports.py all see the same queues
without reaching into each other's private attributes. A request is in exactly one queue while it is
live (none once FINISHED); ``detach`` finds it by its phase.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from services.engine_sim.requests import Phase, SimRequest

# Where each phase's requests count in SGLang's queue gauges.
QUEUED_PHASES = frozenset({Phase.INTAKE, Phase.BOOTSTRAP, Phase.WAITING, Phase.PREALLOC, Phase.READY})


@dataclass(eq=False, slots=True)
class RequestQueues:
    intake: deque[SimRequest] = field(default_factory=deque)  # received, not yet seen by the scheduler
    bootstrap: dict[str, SimRequest] = field(default_factory=dict)  # prefill: room not yet claimed, by rid
    waiting: deque[SimRequest] = field(default_factory=deque)  # prefill/null: FCFS, no KV yet
    prefilling: list[SimRequest] = field(default_factory=list)  # prefill/null: admitted, chunks in progress
    inflight: dict[str, SimRequest] = field(default_factory=dict)  # prefill: KV held for the decode peer
    prealloc: deque[SimRequest] = field(default_factory=deque)  # decode: waiting for KV space
    transfer: dict[str, SimRequest] = field(default_factory=dict)  # decode: pulling KV, by rid
    ready: deque[SimRequest] = field(default_factory=deque)  # decode: KV arrived, waiting for a batch slot
    running: list[SimRequest] = field(default_factory=list)  # decode/null: the running batch, oldest first
    retracted: deque[SimRequest] = field(default_factory=deque)  # decode: evicted for lack of KV

    def detach(self, req: SimRequest) -> None:
        """Take the request out of whatever queue its phase says it is in."""
        phase = req.phase
        if phase is Phase.INTAKE:
            self.intake.remove(req)
        elif phase is Phase.BOOTSTRAP:
            self.bootstrap.pop(req.rid, None)
        elif phase is Phase.WAITING:
            self.waiting.remove(req)
        elif phase is Phase.PREFILLING:
            self.prefilling.remove(req)
        elif phase is Phase.INFLIGHT:
            self.inflight.pop(req.rid, None)
        elif phase is Phase.PREALLOC:
            self.prealloc.remove(req)
        elif phase is Phase.TRANSFER:
            self.transfer.pop(req.rid, None)
        elif phase is Phase.READY:
            self.ready.remove(req)
        elif phase is Phase.RUNNING:
            self.running.remove(req)
        elif phase is Phase.RETRACTED:
            self.retracted.remove(req)

    def counts(self) -> dict[str, int]:
        return {
            "intake": len(self.intake), "bootstrap": len(self.bootstrap), "waiting": len(self.waiting),
            "prefilling": len(self.prefilling), "inflight": len(self.inflight), "prealloc": len(self.prealloc),
            "transfer": len(self.transfer), "ready": len(self.ready), "running": len(self.running),
            "retracted": len(self.retracted),
        }
