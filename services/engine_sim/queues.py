"""The scheduler's per-phase queues: where each live request sits, by its ``Phase``.

The engine model (``shared.engine.model``) owns the scheduling queues (waiting, prefilling, prealloc, ready,
running, retracted); engine_sim adds those of the handoff and of request intake (intake, bootstrap, inflight,
transfer). One container shows them all, so that the engine, batching.py, transfer.py and reports.py see the
same queues without reaching into each other's private attributes. A request is in exactly one queue while
it is live (none once FINISHED).
"""

from __future__ import annotations

from collections import deque

from services.engine_sim.requests import Phase, SimRequest
from shared.engine.model import EngineModel

# Where each phase's requests count in SGLang's queue gauges.
QUEUED_PHASES = frozenset({Phase.INTAKE, Phase.BOOTSTRAP, Phase.WAITING, Phase.PREALLOC, Phase.READY})


class RequestQueues:
    __slots__ = ("core", "intake", "bootstrap", "inflight", "transfer")

    def __init__(self, core: EngineModel) -> None:
        self.core = core
        self.intake: deque[SimRequest] = deque()  # received, not yet seen by the scheduler
        self.bootstrap: dict[str, SimRequest] = {}  # prefill: room not yet claimed, by rid
        self.inflight: dict[str, SimRequest] = {}  # prefill: KV held for the decode peer, by rid
        self.transfer: dict[str, SimRequest] = {}  # decode: pulling KV, by rid

    # The engine model's queues (typed as engine_sim's requests: only they enter this engine's model).
    @property
    def waiting(self) -> deque[SimRequest]:  # prefill/null: no KV yet
        return self.core.waiting  # type: ignore[return-value]

    @property
    def prefilling(self) -> list[SimRequest]:  # prefill/null: admitted, chunks in progress
        return self.core.prefilling  # type: ignore[return-value]

    @property
    def prealloc(self) -> deque[SimRequest]:  # decode: waiting for KV space
        return self.core.prealloc  # type: ignore[return-value]

    @property
    def ready(self) -> deque[SimRequest]:  # decode: KV arrived, waiting for a batch slot
        return self.core.ready  # type: ignore[return-value]

    @property
    def running(self) -> list[SimRequest]:  # decode/null: the running batch, oldest first
        return self.core.running  # type: ignore[return-value]

    @property
    def retracted(self) -> deque[SimRequest]:  # decode: evicted for lack of KV
        return self.core.retracted  # type: ignore[return-value]

    def detach(self, req: SimRequest, now: float) -> None:
        """Take the request out of whatever queue its phase says it is in, and free what it holds."""
        phase = req.phase
        if phase is Phase.INTAKE:
            self.intake.remove(req)
        elif phase is Phase.BOOTSTRAP:
            self.bootstrap.pop(req.rid, None)
        elif phase is Phase.FINISHED:
            return  # the model ended it (KV freed)
        else:
            if phase is Phase.INFLIGHT:
                self.inflight.pop(req.rid, None)
            elif phase is Phase.TRANSFER:
                self.transfer.pop(req.rid, None)
            self.core.remove(req, now)

    def counts(self) -> dict[str, int]:
        return {
            "intake": len(self.intake), "bootstrap": len(self.bootstrap), "waiting": len(self.waiting),
            "prefilling": len(self.prefilling), "inflight": len(self.inflight), "prealloc": len(self.prealloc),
            "transfer": len(self.transfer), "ready": len(self.ready), "running": len(self.running),
            "retracted": len(self.retracted),
        }
