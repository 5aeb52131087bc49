"""Keeps the dev stack's processes running: a process that exits is started again with back-off, and the
stack gives up only when one keeps crashing.

What a restart costs, per process (docs/fault-tolerance.md has the measurements):

- a worker sidecar: nothing in flight. The gateway streams straight from the engines, and the restarted
  sidecar adopts the engine its last run left running (``services/worker/launcher.py``: the pid file).
- the monitor, planner, migrator: nothing in flight; the planner's leader lease lapses and is taken again.
- nats-server, etcd: the services reconnect (the gateway keeps serving from its last view meanwhile).
- the gateway: the requests it was serving are lost (their clients' connections were to it). A deployment
  avoids that with several gateways behind a load balancer (compose and ``make deploy`` run two).

A worker that exits with status 0 retired on purpose (the planner scaled it in) and is not restarted.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from shared.devservers import ManagedProcess
from shared.runtime import restart_delay


@dataclass(frozen=True)
class RestartPolicy:
    backoff_s: float = 1.0  # first restart after this long, doubling per crash within the window
    backoff_max_s: float = 30.0
    max_crashes: int = 5  # more crashes than this within window_s, and the stack gives up
    window_s: float = 300.0


@dataclass
class _Watch:
    crashes: list[float] = field(default_factory=list)  # when each exit was noticed
    restart_at: float | None = None  # set while a restart waits out its back-off


class Supervisor:
    """Call :meth:`poll` about once a second; it restarts what exited and returns why to give up, if so."""

    def __init__(self, processes: Sequence[ManagedProcess], policy: RestartPolicy | None = None, *,
                 say: Callable[[str], None] = lambda line: None, clock: Callable[[], float] = time.monotonic) -> None:
        self._processes = processes
        self.policy = policy or RestartPolicy()
        self._say = say
        self._clock = clock
        self._watch: dict[str, _Watch] = {}
        self.restarts = 0

    def poll(self) -> str | None:
        now = self._clock()
        for proc in self._processes:
            if proc.alive or retired(proc):
                continue
            watch = self._watch.setdefault(proc.name, _Watch())
            if watch.restart_at is None:
                watch.crashes = [t for t in watch.crashes if now - t < self.policy.window_s] + [now]
                if len(watch.crashes) > self.policy.max_crashes:
                    return (f"{proc.name} exited {len(watch.crashes)} times within {self.policy.window_s:.0f}s (last exit "
                            f"code {proc.proc.returncode}); last lines of {proc.log_path}:\n{proc.tail()}")
                delay = restart_delay(len(watch.crashes), self.policy.backoff_s, self.policy.backoff_max_s)
                watch.restart_at = now + delay
                self._say(f"{proc.name} exited with code {proc.proc.returncode}; restarting it in {delay:.0f}s "
                          f"(crash {len(watch.crashes)} of at most {self.policy.max_crashes} in "
                          f"{self.policy.window_s:.0f}s; log {proc.log_path})")
            if now >= watch.restart_at:
                watch.restart_at = None
                proc.restart()
                self.restarts += 1
                self._say(f"{proc.name} restarted (pid {proc.proc.pid})")
        return None


def retired(proc: ManagedProcess) -> bool:
    """A worker that exited 0 retired on purpose (the planner scaled it in): it is not restarted, nor dead."""
    return proc.name.startswith("worker-") and proc.proc.returncode == 0
