"""One stack per state directory, and no stack on ports something else holds.

``poise up`` (and ``poise run``) take an exclusive ``flock`` on ``<state dir>/stack.lock`` for as long as they
run. The kernel drops it when the process ends, however it ends (a ``kill -9`` included), so a stale lock
cannot block the next start; while it is held, a second ``poise up`` in the same directory is refused with
the holder's pid and gateway, instead of starting beside it and overwriting its ``current.json``.

The fixed ports a stack is asked for are tried before anything starts: a busy gateway port would otherwise
let the new stack's readiness check talk to whatever already answers there.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
from collections.abc import Iterable
from pathlib import Path
from typing import IO

from shared.devservers import port_available
from shared.errors import PoiseError


class StackLock:
    """The held lock of ``state_dir``; :meth:`release` (or the process's end) gives it back."""

    def __init__(self, state_dir: Path) -> None:
        state_dir.mkdir(parents=True, exist_ok=True)
        self.path = state_dir / "stack.lock"
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)
        self._file: IO[str] | None = os.fdopen(fd, "r+")
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _read_holder(self._file)
            self._file.close()
            self._file = None
            raise PoiseError(
                f"a Poise stack is already running from {state_dir.resolve()} ({holder}); stop it first (Ctrl-C in "
                f"its terminal, or kill the pid), or start this one with another --state-dir") from None
        self.describe()

    def describe(self, **fields: object) -> None:
        """Say who holds the lock (the pid, and what the caller adds, e.g. the gateway URL) for a refused start."""
        if self._file is None:
            return
        self._file.seek(0)
        self._file.truncate()
        self._file.write(json.dumps({"pid": os.getpid(), **fields}))
        self._file.flush()

    def release(self) -> None:
        if self._file is not None:
            with contextlib.suppress(OSError):
                self._file.seek(0)
                self._file.truncate()
            self._file.close()  # closing the descriptor drops the flock
            self._file = None


def _read_holder(file: IO[str]) -> str:
    with contextlib.suppress(OSError, ValueError):
        file.seek(0)
        info = json.loads(file.read() or "{}")
        parts = [f"pid {info['pid']}"] if "pid" in info else []
        parts += [f"{k.replace('_', ' ')} {v}" for k, v in info.items() if k != "pid"]
        if parts:
            return ", ".join(parts)
    return "holder unknown"


def check_ports_free(host: str, ports: Iterable[tuple[str, int]]) -> None:
    """Raise :class:`PoiseError` naming every ``(what, port)`` (port 0 = any, skipped) that cannot be bound."""
    busy = [f"{what} port {host}:{port}" for what, port in ports if port and not port_available(host, port)]
    if busy:
        raise PoiseError(f"cannot start the stack, in use: {'; '.join(busy)}. Stop what holds it, or pick other ports "
                         f"(--gateway-port, --monitor-port, --nats-port, --etcd-port; 0 = any free port)")
