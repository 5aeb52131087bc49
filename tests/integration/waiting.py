"""Polling helpers the integration tests share: state that changes between event-loop turns has no event to
await, so tests poll it with a deadline."""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Awaitable, Callable


async def until(predicate: Callable[[], bool], timeout_s: float = 10.0, poll_s: float = 0.02) -> None:
    """Return once ``predicate()`` is true; fail the test after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError("condition not reached in time")
        await asyncio.sleep(poll_s)


async def until_equal(probe: Callable[[], Awaitable[object]], want: object, timeout_s: float = 30.0,
                      poll_s: float = 0.1) -> None:
    """Return once ``await probe()`` gives ``want`` (a state read over the network); fail with the last value."""
    deadline = time.monotonic() + timeout_s
    while (got := await probe()) != want:
        if time.monotonic() > deadline:
            raise AssertionError(f"still {got!r}, want {want!r}")
        await asyncio.sleep(poll_s)


def process_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True
