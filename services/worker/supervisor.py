"""Keeping a spawned engine up: restart it when it exits, with exponential back-off, and give up after
``restart_max_failures`` failures in a row, so the sidecar's own supervisor (systemd, Kubernetes,
``poise up``) sees a process that cannot serve.

Failures count consecutively: the exit itself, then each restart that does not become healthy. An engine
that ran longer than ``restart_backoff_max_s`` before exiting starts the count over. The sidecar says how to
take the engine out of service, how to bring a new one up (launch, health, registration) and what to do on
giving up; the supervisor owns the loop and its counters.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable

from services.worker.config import WorkerSettings
from services.worker.launcher import EngineProcess
from shared.errors import PoiseError
from shared.registry import ETCD_ERRORS
from shared.runtime import restart_delay

log = logging.getLogger(__name__)

RESTART_ERRORS: tuple[type[BaseException], ...] = (PoiseError, OSError, *ETCD_ERRORS)


class EngineSupervisor:
    def __init__(self, settings: WorkerSettings, *, engine: Callable[[], EngineProcess | None],
                 stopping: Callable[[], bool], take_down: Callable[[], Awaitable[None]],
                 bring_up: Callable[[], Awaitable[None]], give_up: Callable[[int], None],
                 note_error: Callable[[str], None]) -> None:
        self._s = settings
        self._engine, self._stopping = engine, stopping
        self._take_down, self._bring_up, self._give_up, self._note = take_down, bring_up, give_up, note_error
        self.restarting = False  # the supervisor owns the registration while it restarts the engine
        self.restarts = 0

    async def run(self) -> None:
        """Watch the current engine until the sidecar stops, or gives up."""
        s, name = self._s, self._s.instance_id
        failures = 0
        while True:
            engine = self._engine()
            assert engine is not None
            started = time.monotonic()
            code = await engine.wait()
            if self._stopping():
                return
            ran_s = time.monotonic() - started
            if ran_s > s.restart_backoff_max_s:
                failures = 0  # it ran a good while: start the back-off over
            failures += 1
            log.error("engine of %s exited with code %s after %.1fs; last lines of %s:\n%s", name, code, ran_s,
                      engine.log_path, engine.tail())
            self._note(f"engine exited with code {code} after {ran_s:.1f}s")
            self.restarting = True
            await self._take_down()
            await engine.stop(s.stop_timeout_s)  # closes the log file
            if not await self._restart(failures):
                return
            self.restarts += 1
            self.restarting = False

    async def _restart(self, failures: int) -> bool:
        """Bring a new engine up, retrying with back-off; False once it gave up."""
        s = self._s
        while True:
            if s.restart_max_failures and failures >= s.restart_max_failures:
                self._give_up(failures)
                return False
            delay = restart_delay(failures, s.restart_backoff_s, s.restart_backoff_max_s)
            log.info("restarting the engine of %s in %.1fs (consecutive failures: %d)", s.instance_id, delay, failures)
            await asyncio.sleep(delay)
            try:
                await self._bring_up()
                return True
            except RESTART_ERRORS as exc:
                failures += 1
                log.error("restart of %s failed: %s", s.instance_id, exc)
                self._note(f"restart failed: {exc}")
                engine = self._engine()
                if engine is not None:
                    await engine.stop(s.stop_timeout_s)
