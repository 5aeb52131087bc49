"""The engine state that engine_sim's plain-function modules (batching.py, transfer.py, reports.py) read and
write: a Protocol that :class:`services.engine_sim.engine.SimEngine` satisfies, so that those modules depend
on what they use and not on the engine module (which imports them), and a test can hand them a smaller engine.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Coroutine
from http import HTTPStatus
from typing import Any, Protocol

from services.engine_sim.config import EngineSimSettings, Mode
from services.engine_sim.handoff import RoomRegistry
from services.engine_sim.metrics import EngineMetrics, ThroughputWindow
from services.engine_sim.queues import RequestQueues
from services.engine_sim.requests import SimRequest
from shared.engine.model import EngineModel
from shared.http1 import Http1Pool
from shared.latency import LatencyModel, LatencyProfile


class EngineState(Protocol):
    """What a step, a KV handoff and a load report touch on an engine (``SimEngine`` documents each field)."""

    settings: EngineSimSettings
    profile: LatencyProfile
    latency: LatencyModel
    capacity: int
    max_running: int
    chunk_size: int
    chunked: bool
    mode: Mode
    core: EngineModel
    queues: RequestQueues
    rooms: RoomRegistry
    client: Http1Pool | None
    metrics: EngineMetrics
    window: ThroughputWindow
    stopping: bool
    startup_unix_s: float
    startup_s: float
    # the /v1/loads counters
    total_prefill_tokens: int
    total_prefill_busy_us: int
    prefill_samples: deque[tuple[int, int, float]]
    prefill_sample_seq: int
    decode_moments: list[float]
    last_kv_transfer_ms: float
    last_kv_transfer_gb_s: float
    num_retracted_total: int
    num_prefill_preemptions: int
    # the prompts that entered the waiting queue, and when the last did (operator preemption re-plans on them)
    prefill_arrivals: int
    last_prefill_arrival_s: float

    @property
    def paused(self) -> bool: ...

    def snapshot_unix_s(self) -> float: ...

    def spawn(self, coro: Coroutine[Any, Any, Any]) -> None: ...

    def kick(self) -> None: ...

    def enqueue_waiting(self, req: SimRequest) -> None: ...

    def finish_request(self, req: SimRequest, reason: dict[str, Any], *, detach: bool = True) -> None: ...

    def fail_request(self, req: SimRequest, message: str, status: HTTPStatus, *, detach: bool = True) -> None: ...
