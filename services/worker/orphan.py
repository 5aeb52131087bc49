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
import logging
import os
import signal
from pathlib import Path

log = logging.getLogger(__name__)

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


def kill_group(pid: int, sig: signal.Signals) -> None:
    # The engine leads its own session (start_new_session); SGLang's children are in its group.
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, sig)


class AdoptedEngine:
    """An engine a previous sidecar run started, with :class:`~services.worker.launcher.EngineProcess`'s
    interface (not our child: its exit is polled, its exit code is unknown)."""

    def __init__(self, pid: int, argv: list[str], log_path: Path) -> None:
        self.pid: int | None = pid
        self.argv = argv
        self.log_path = log_path
        self.returncode: int | None = None

    async def start(self) -> None:
        """It is running already."""

    def _gone(self) -> bool:
        return self.pid is None or _cmdline(self.pid) != self.argv

    async def wait(self) -> int:
        while not self._gone():  # noqa: ASYNC110 - not our child: nothing signals its exit, so poll
            await asyncio.sleep(POLL_S)
        self.returncode = -1 if self.returncode is None else self.returncode  # unknown: not our child
        return self.returncode

    async def stop(self, timeout_s: float = 15.0) -> int | None:
        if self.pid is not None and not self._gone():
            kill_group(self.pid, signal.SIGTERM)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.wait(), timeout_s)
            if not self._gone():
                log.warning("adopted engine pid %d ignored SIGTERM for %.0fs; killing it", self.pid, timeout_s)
                kill_group(self.pid, signal.SIGKILL)
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self.wait(), 5)
        return self.returncode

    def tail(self, lines: int = 20) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""
