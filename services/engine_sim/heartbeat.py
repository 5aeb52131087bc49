"""The scheduler's heartbeat: when it last made progress, and what SGLang's ``/health`` and load snapshot
make of that.

SGLang's ``/health`` (``health_generate``) runs a one-token request through the scheduler, so it passes
once the scheduler produces something (a step ends) or is free to run it at once, and fails when nothing
comes within the timeout: a scheduler hung while the HTTP server still answers (a wedged kernel) fails it.
Its load snapshot is stamped when the scheduler publishes: every 50 ms while it loops without a batch, else
after each batch, so the stamp stops advancing while a step hangs.
"""

from __future__ import annotations

import asyncio

from services.engine_sim import clock


class Heartbeat:
    __slots__ = ("_beat", "_last_unix_s", "awaiting_work")

    def __init__(self) -> None:
        self._beat = asyncio.Event()  # set (and replaced) at each beat; a health check waits on it
        self._last_unix_s = clock.unix()
        self.awaiting_work = False  # the scheduler has nothing to compute (it would run a check at once)

    def beat(self) -> None:
        """The scheduler made progress: a step ended, or it ran out of work."""
        self._last_unix_s = clock.unix()
        self._beat.set()
        self._beat = asyncio.Event()

    def snapshot_unix_s(self, *, looping: bool) -> float:
        """The load snapshot's stamp: now while the scheduler loops without a batch (``looping``: idle, paused
        or switching, and not frozen), else the end of its last step."""
        return clock.unix() if looping else self._last_unix_s

    async def healthy(self, timeout_s: float, *, free: bool) -> bool:
        """True once the scheduler is ``free`` to run the check's request, or beats within ``timeout_s``."""
        if free:
            return True
        beat = self._beat
        try:
            await asyncio.wait_for(beat.wait(), timeout_s)
        except TimeoutError:
            return False
        return True
