"""Waiting on an engine: until it answers ``/health`` (after a start), and until it is idle (a drain)."""

from __future__ import annotations

import asyncio
import time

from services.worker.launcher import EngineProcess
from shared.engine_client import EngineClient
from shared.errors import EngineError, EngineTimeout, PoiseError


class DrainTimeout(PoiseError, TimeoutError):
    """The engine did not go idle within the drain timeout of a role switch."""


async def wait_healthy(client: EngineClient, engine: EngineProcess | None, *, instance_id: str,
                       url: str, timeout_s: float) -> None:
    """Return once ``/health`` is OK; raise :class:`EngineError` if the spawned ``engine`` exits first,
    :class:`EngineTimeout` (with the engine log's tail) after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    last = "no answer yet"
    delay = 0.05
    while True:
        if engine is not None and engine.returncode is not None:
            raise EngineError(instance_id, f"engine exited with code {engine.returncode} before it became "
                              f"healthy; last lines of {engine.log_path}:\n{engine.tail()}")
        try:
            if await client.health():
                return
            last = "/health answered 503 (starting)"
        except EngineError as exc:
            last = str(exc)
        if time.monotonic() >= deadline:
            tail = f"; last lines of {engine.log_path}:\n{engine.tail()}" if engine is not None else ""
            raise EngineTimeout(instance_id, f"{url}/health not OK after {timeout_s:.0f}s ({last}){tail}")
        await asyncio.sleep(delay)
        delay = min(delay * 2, 0.5)


async def wait_idle(client: EngineClient, timeout_s: float, poll_s: float) -> None:
    """Return once two consecutive ``/v1/loads`` reads show the engine idle; raise :class:`DrainTimeout`."""
    deadline = time.monotonic() + timeout_s
    idle_reads = 0
    last = "no load reading"
    while True:
        try:
            loads = await client.loads()
            idle_reads = idle_reads + 1 if loads.idle else 0
            last = (f"running={loads.num_running_reqs} waiting={loads.num_waiting_reqs} "
                    f"prefill_queue={loads.prefill_queue_reqs} decode_queue={loads.decode_queue_reqs}")
        except EngineError as exc:
            idle_reads = 0
            last = str(exc)
        if idle_reads >= 2:
            return
        if time.monotonic() >= deadline:
            raise DrainTimeout(f"engine not idle after {timeout_s:.1f}s ({last})")
        await asyncio.sleep(poll_s)
