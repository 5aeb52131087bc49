"""Injected time, so the live services and the simulator drive the same code.

Policies never read the clock: they receive ``now_s``. Services use :class:`WallClock`; the simulator
uses :class:`VirtualClock` and advances it itself.
"""

from __future__ import annotations

import asyncio
import time
from typing import Protocol


class Clock(Protocol):
    def now(self) -> float:
        """Seconds since an arbitrary, fixed origin (monotonic)."""
        ...

    async def sleep(self, seconds: float) -> None: ...


class WallClock:
    """Monotonic real time."""

    def now(self) -> float:
        return time.monotonic()

    async def sleep(self, seconds: float) -> None:
        await asyncio.sleep(max(0.0, seconds))


class VirtualClock:
    """Time that moves only when the owner advances it (discrete-event simulation)."""

    def __init__(self, start_s: float = 0.0) -> None:
        self._now = start_s

    def now(self) -> float:
        return self._now

    def advance_to(self, t_s: float) -> None:
        if t_s < self._now:
            raise ValueError(f"virtual time cannot go back: {t_s} < {self._now}")
        self._now = t_s

    async def sleep(self, seconds: float) -> None:
        self._now += max(0.0, seconds)
