"""The engine a previous run of this sidecar left running: adopt it, or stop it.

The engine runs in its own session, so it outlives a sidecar that is killed outright (``kill -9``, an OOM
kill). Its requests do not go through the sidecar (the gateway streams from the engine), so the engine can
go on serving while the sidecar is restarted. The sidecar writes ``engine-<instance>.pid`` (the pid and the
argv) next to the engine's log when it launches one and removes it when it stops it. A restarted sidecar
reads it:

- the process is gone, or its command line is not the recorded one (the pid was reused): nothing to do;
- it runs the command this sidecar would launch: **adopt** it (wait for ``/health``, read its role from the
  engine, since a flip may have changed it, and register it again);
- it runs another command (the sidecar's settings changed): stop it, so it does not hold the ports.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
from pathlib import Path

from services.worker.launcher import EngineProcess, signal_group

POLL_S = 0.5  # how often an adopted engine (not our child: no wait()) is checked for having exited


def pid_file(log_dir: Path, instance_id: str) -> Path:
    return log_dir / f"engine-{instance_id}.pid"


def write_pid_file(path: Path, pid: int, argv: list[str]) -> None:
    """Readable by this user only: an SGLang engine's argv carries its API key."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(json.dumps({"pid": pid, "argv": argv}))


def remove_pid_file(path: Path, pid: int | None) -> None:
    """Remove it if it still names ``pid`` (a newer run's file is left alone)."""
    with contextlib.suppress(OSError, ValueError, KeyError):
        if json.loads(path.read_text())["pid"] == pid:
            path.unlink()


def _cmdline(pid: int) -> list[str] | None:
    try:
        raw = Path(f"/proc/{pid}/cmdline").read_bytes()
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return None
    if state == "Z":  # exited, not yet reaped by its new parent
        return None
    return [part.decode(errors="replace") for part in raw.split(b"\0")[:-1]]


def previous_engine(path: Path) -> tuple[int, list[str]] | None:
    """(pid, argv) of the engine a previous run launched, if that process still runs that command."""
    try:
        recorded = json.loads(path.read_text())
        pid, argv = int(recorded["pid"]), [str(a) for a in recorded["argv"]]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    if _cmdline(pid) != argv:
        with contextlib.suppress(OSError):
            path.unlink()
        return None
    return pid, argv


class AdoptedEngine(EngineProcess):
    """An engine a previous sidecar run started, run and stopped as an :class:`EngineProcess` (not our child:
    its exit is polled, and its exit code is unknown)."""

    def __init__(self, pid: int, argv: list[str], log_path: Path) -> None:
        super().__init__(argv, log_path)
        self._pid = pid
        self._returncode: int | None = None

    @property
    def pid(self) -> int | None:
        return self._pid

    @property
    def returncode(self) -> int | None:
        return self._returncode

    async def start(self) -> None:
        """It is running already."""

    def _running(self) -> bool:
        return _cmdline(self._pid) == self.argv

    def _send(self, sig: signal.Signals) -> None:
        signal_group(self._pid, sig)

    async def wait(self) -> int:
        while self._running():  # noqa: ASYNC110 - not our child: nothing signals its exit, so poll
            await asyncio.sleep(POLL_S)
        self._returncode = -1  # unknown: not our child
        return self._returncode
