"""The lifecycle every Poise process shares: run a service until SIGTERM/SIGINT, answer admin commands.

A service is any object with an async ``start()`` and an idempotent async ``stop()`` (:class:`Service`).
:func:`run_service` starts it, waits for a signal (or for the service to ask to stop), then stops it
once. :class:`AdminEndpoint` answers ``Subjects.admin(<service>)`` with :class:`AdminReply`: ``status``
and ``help`` everywhere, plus the verbs a service registers. :class:`EmbeddedHttpServer` runs a uvicorn
app inside the service's event loop without taking over its signal handling.

Owns no policy and no message types; imports uvicorn only when an HTTP server is actually started.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import socket
import time
from collections.abc import Awaitable, Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, Self

from shared.bus import Bus
from shared.errors import PoiseError
from shared.protocol import (
    AdminCommand,
    AdminReply,
    ClusterSnapshot,
    ServiceStatus,
    SnapshotReply,
    SnapshotRequest,
    Subjects,
)

if TYPE_CHECKING:
    import uvicorn

log = logging.getLogger(__name__)

ADMIN_QUEUE = "admin"
"""Queue group of the admin subjects: with several replicas, each admin command is answered by one of them
(its ``ServiceStatus`` names the replica and whether it leads)."""


class Service(Protocol):
    """What :func:`run_service` drives."""

    name: str

    async def start(self) -> None: ...

    async def stop(self) -> None: ...


def replica_id() -> str:
    """``hostname:pid``: names one process of one service for leader election and ``status``."""
    return f"{socket.gethostname()}:{os.getpid()}"


async def run_service(service: Service, *, stop_event: asyncio.Event | None = None,
                      signals: tuple[signal.Signals, ...] = (signal.SIGTERM, signal.SIGINT)) -> int:
    """Start ``service``, wait until a signal arrives or ``stop_event`` is set, stop it; return an exit code.

    A service may set ``stop_event`` itself (pass the same event to it) to end the process, e.g. after a
    fatal error in a background task. ``stop()`` runs exactly once, also when ``start()`` fails.
    """
    loop = asyncio.get_running_loop()
    stop_event = stop_event or asyncio.Event()
    installed: list[signal.Signals] = []
    for sig in signals:
        try:
            loop.add_signal_handler(sig, _on_signal, sig, stop_event)
            installed.append(sig)
        except (NotImplementedError, RuntimeError, ValueError):  # not the main thread, or no unix signals
            log.debug("cannot install a handler for %s", sig.name)
    code = 0
    starting = asyncio.create_task(service.start(), name=f"{service.name}-start")
    stopping = asyncio.create_task(stop_event.wait(), name=f"{service.name}-stop-wait")
    try:
        await asyncio.wait({starting, stopping}, return_when=asyncio.FIRST_COMPLETED)
        if not starting.done():  # a signal during a long start (an engine loading weights): give up on it
            log.info("%s: stop requested while starting", service.name)
            starting.cancel()
        try:
            await starting
        except asyncio.CancelledError:
            if not stop_event.is_set():
                raise
        except Exception:
            log.exception("%s failed to start", service.name)
            code = 1
        else:
            log.info("%s started", service.name)
            await stopping
    finally:
        for task in (starting, stopping):
            if not task.done():
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await task
        try:
            await service.stop()
        except Exception:
            log.exception("%s did not stop cleanly", service.name)
            code = code or 1
        for sig in installed:
            loop.remove_signal_handler(sig)
    log.info("%s stopped", service.name)
    return code


def _on_signal(sig: signal.Signals, stop_event: asyncio.Event) -> None:
    log.info("received %s; stopping", sig.name)
    stop_event.set()


async def cancel_and_wait(tasks: Iterable[asyncio.Task[Any]]) -> None:
    """Cancel background tasks and wait until they have ended (their errors are not re-raised: we are stopping)."""
    tasks = list(tasks)
    for task in tasks:
        task.cancel()
    for task in tasks:
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await task


class AsyncServiceMixin:
    """``async with service:`` starts it and stops it (tests and embedders use this form)."""

    async def start(self) -> None:
        raise NotImplementedError

    async def stop(self) -> None:
        raise NotImplementedError

    async def __aenter__(self) -> Self:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()


class StopOnce:
    """Makes a ``stop()`` idempotent: the first call runs it, later and concurrent calls wait for that one."""

    def __init__(self) -> None:
        self._task: asyncio.Task[None] | None = None

    @property
    def stopping(self) -> bool:
        return self._task is not None

    async def run(self, stop: Callable[[], Awaitable[None]]) -> None:
        if self._task is None:
            self._task = asyncio.ensure_future(stop())
        await asyncio.shield(self._task)


# -- admin -----------------------------------------------------------------------------------------

AdminHandler = Callable[[dict[str, str]], Awaitable[AdminReply]]


@dataclass(frozen=True)
class _Verb:
    handler: AdminHandler
    usage: str


class AdminEndpoint:
    """Serves ``Subjects.admin(service)``: ``status`` (a :class:`ServiceStatus`), ``help`` and registered verbs.

    Requests are answered concurrently (a slow verb such as ``set-role`` does not hold up ``status``).
    A verb handler raising :class:`shared.errors.PoiseError` or ``ValueError`` is answered with ok=false
    and the error's text.
    """

    def __init__(self, bus: Bus, subjects: Subjects, service: str, status: Callable[[], ServiceStatus], *,
                 subject: str | None = None, refresh: Callable[[], Awaitable[None]] | None = None) -> None:
        # ``subject``: serve another subject the same way (a service's control subject, for other services).
        # ``refresh``: awaited before ``status`` answers, for state a follower replica does not keep current
        # (the admin queue group may hand ``status`` to any replica).
        self.subject = subject or subjects.admin(service)
        self._bus = bus
        self._status = status
        self._refresh = refresh
        self._verbs: dict[str, _Verb] = {}
        self._sub: Any = None
        self.register("status", self._status_verb, "status: this replica's ServiceStatus")
        self.register("help", self._help_verb, "help: list the verbs")

    def register(self, verb: str, handler: AdminHandler, usage: str) -> None:
        """Add a verb; ``usage`` is one line like ``set-role instance=<id> role=prefill|decode``."""
        if verb in self._verbs:
            raise ValueError(f"admin verb {verb!r} is already registered")
        self._verbs[verb] = _Verb(handler, usage)

    @property
    def verbs(self) -> list[str]:
        return sorted(self._verbs)

    async def start(self) -> None:
        self._sub = await self._bus.serve(
            self.subject, AdminCommand, self.handle, error_reply=lambda m: AdminReply(ok=False, message=m),
            queue=ADMIN_QUEUE, concurrent=True,
        )

    async def stop(self) -> None:
        sub, self._sub = self._sub, None
        if sub is not None:
            with contextlib.suppress(Exception):  # the connection may already be closed
                await sub.unsubscribe()

    async def handle(self, command: AdminCommand) -> AdminReply:
        verb = self._verbs.get(command.verb)
        if verb is None:
            return AdminReply(ok=False, message=f"unknown verb {command.verb!r}; known: {', '.join(self.verbs)}",
                              status=self._status())
        try:
            return await verb.handler(dict(command.args))
        except (ValueError, KeyError) as exc:
            return AdminReply(ok=False, message=f"{command.verb}: {exc}; usage: {verb.usage}")

    async def _status_verb(self, args: dict[str, str]) -> AdminReply:
        if self._refresh is not None:
            await self._refresh()
        return AdminReply(ok=True, status=self._status())

    async def _help_verb(self, args: dict[str, str]) -> AdminReply:
        return AdminReply(ok=True, message="\n".join(self._verbs[v].usage for v in self.verbs))


def restart_delay(failures: int, first_s: float, max_s: float) -> float:
    """Back-off before the next restart after ``failures`` consecutive failures (1 = the first): doubles, capped."""
    return min(first_s * 2 ** max(0, failures - 1), max_s)


def require_arg(args: dict[str, str], name: str) -> str:
    """An admin argument that must be present and non-empty (raises ``ValueError`` otherwise)."""
    value = args.get(name, "").strip()
    if not value:
        raise ValueError(f"missing argument {name!r}")
    return value


class Uptime:
    """Seconds since construction (monotonic), for ``ServiceStatus.uptime_s``."""

    def __init__(self) -> None:
        self._t0 = time.monotonic()

    def __call__(self) -> float:
        return time.monotonic() - self._t0


async def fetch_snapshot(bus: Bus, subjects: Subjects, timeout_s: float = 2.0, series_points: int = 60) -> ClusterSnapshot:
    """Ask the monitor for a :class:`ClusterSnapshot`; raises :class:`shared.errors.BusTimeout` or ``PoiseError``."""
    reply = await bus.request(subjects.monitor_snapshot(), SnapshotRequest(series_points=series_points), SnapshotReply,
                              timeout_s=timeout_s)
    if not reply.ok or reply.snapshot is None:
        raise PoiseError(f"the monitor gave no snapshot: {reply.message}")
    return reply.snapshot


# -- embedded HTTP -------------------------------------------------------------------------------


class EmbeddedHttpServer:
    """A uvicorn server run as a task of the current loop (``/metrics`` and small status apps).

    uvicorn's own ``serve()`` replaces the process's SIGINT/SIGTERM handlers; here it leaves them to
    :func:`run_service`. ``port=0`` binds a free port, readable from :attr:`port` after :meth:`start`.
    """

    def __init__(self, app: Any, host: str, port: int, *, name: str = "http") -> None:
        self._app = app
        self.host = host
        self.port = port
        self._name = name
        self._server: uvicorn.Server | None = None
        self._task: asyncio.Task[None] | None = None
        self._socket: socket.socket | None = None

    async def start(self, timeout_s: float = 10.0) -> None:
        import uvicorn

        class _Server(uvicorn.Server):
            @contextlib.contextmanager
            def capture_signals(self) -> Iterator[None]:
                yield

        sock = socket.socket(socket.AF_INET6 if ":" in self.host else socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((self.host, self.port))
        self.port = int(sock.getsockname()[1])
        self._socket = sock
        config = uvicorn.Config(self._app, log_level="warning", lifespan="on", access_log=False)
        self._server = _Server(config)
        self._task = asyncio.create_task(self._server.serve(sockets=[sock]), name=f"{self._name}-server")
        deadline = time.monotonic() + timeout_s
        while not self._server.started:
            if self._task.done():
                self._task.result()  # raises the startup error
                raise RuntimeError(f"{self._name} server exited during startup")
            if time.monotonic() > deadline:
                raise TimeoutError(f"{self._name} server did not start on {self.host}:{self.port} in {timeout_s}s")
            await asyncio.sleep(0.01)

    async def stop(self) -> None:
        server, task = self._server, self._task
        self._server = self._task = None
        if server is not None and task is not None:
            server.should_exit = True
            try:
                await asyncio.wait_for(asyncio.shield(task), timeout=5)
            except TimeoutError:
                server.force_exit = True
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await task
        if self._socket is not None:
            self._socket.close()
            self._socket = None


# -- leader-only periodic work -------------------------------------------------------------------


class LeaderTicker:
    """Calls ``tick()`` every ``interval_s`` while ``is_leader()`` is true (planner, migrator).

    ``tick`` may return the seconds until it wants to run again (``None``: the regular interval). A tick
    that raises is logged and counted; the loop goes on. Followers only wait.
    """

    def __init__(self, tick: Callable[[], Awaitable[float | None]], is_leader: Callable[[], bool],
                 interval_s: float, *, name: str = "tick") -> None:
        self._tick = tick
        self._is_leader = is_leader
        self.interval_s = interval_s
        self._name = name
        self._task: asyncio.Task[None] | None = None
        self.ticks = 0
        self.errors = 0
        self.last_error: str | None = None
        self.last_tick_unix_s: float | None = None

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name=self._name)

    async def stop(self) -> None:
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    async def _run(self) -> None:
        while True:
            delay = self.interval_s
            if self._is_leader():
                try:
                    wanted = await self._tick()
                    if wanted is not None:
                        delay = max(wanted, 0.05)
                except asyncio.CancelledError:
                    raise
                except Exception as exc:  # one bad tick must not end the loop
                    self.errors += 1
                    self.last_error = f"{type(exc).__name__}: {exc}"
                    log.exception("%s failed", self._name)
                self.ticks += 1
                self.last_tick_unix_s = time.time()
            await asyncio.sleep(delay)
