"""The processes ``poise up`` starts, listed without starting any: the reference the docker-compose dev stack
(``deploy/docker-compose.yml``) is checked against.

``services/cli/stack.py`` builds its command lines inside :meth:`Stack._start`, interleaved with starting the
processes, and has no call that only lists them. :func:`poise_up_processes` therefore runs that same method
with process creation replaced by a recorder: ``ManagedProcess.__init__`` records its argv instead of
spawning (with the POISE_* variables it would set), the wait for nats-server's and etcd's ports, etcd's auth
set-up and the wait for the engines to register are skipped, and no state file is written. Every flag comes from the real code, so a flag ``poise up`` adds or drops shows up
here. If ``stack.py`` renames what is replaced here, :class:`StackCaptureError` says so.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from unittest import mock

from shared.errors import PoiseError


class StackCaptureError(PoiseError):
    """``poise up``'s process list could not be captured (stack.py changed shape)."""


@dataclass(frozen=True)
class StackProcess:
    """One process of the dev stack as ``poise up`` would start it."""

    name: str  # nats-server, etcd, monitor, planner, migrator, gateway, worker-<id>
    argv: tuple[str, ...]  # the full command line; argv[0] is the python or server binary
    env: tuple[tuple[str, str], ...] = ()  # POISE_* variables poise up sets for it (credentials, API keys)

    @property
    def module(self) -> str | None:
        """``services.X`` for ``python -m services.X``; ``None`` for nats-server and etcd."""
        if len(self.argv) >= 3 and self.argv[1] == "-m":
            return self.argv[2]
        return None

    @property
    def args(self) -> tuple[str, ...]:
        """The arguments after ``python -m module`` (or after the binary)."""
        return self.argv[3:] if self.module is not None else self.argv[1:]


@contextlib.contextmanager
def _recording() -> Iterator[list[StackProcess]]:
    from shared import devservers

    recorded: list[StackProcess] = []

    def record(self: Any, name: str, args: list[str], log_path: Path, env: dict[str, str] | None = None) -> None:
        self.name = name
        self.log_path = log_path
        self.proc = None
        given = {k: v for k, v in (env or {}).items() if k.startswith("POISE_") and os.environ.get(k) != v}
        recorded.append(StackProcess(name=name, argv=tuple(str(a) for a in args), env=tuple(sorted(given.items()))))

    try:
        with (mock.patch.object(devservers.ManagedProcess, "__init__", record),
              mock.patch.object(devservers, "wait_for_port", lambda *a, **k: None),
              mock.patch.object(devservers.EtcdServer, "_enable_auth", lambda self, auth: None),
              mock.patch.object(devservers, "find_binary", lambda name, package: name)):
            yield recorded
    except AttributeError as exc:  # mock.patch.object on a name that no longer exists
        raise StackCaptureError(f"shared.devservers changed: {exc}") from exc


def poise_up_processes(settings: Any = None) -> list[StackProcess]:
    """Every process ``poise up`` starts, in order, for ``settings`` (default: read as ``poise up`` reads them).

    Ports that ``poise up`` takes free at start are whatever was free now; compare them as "a port".
    """
    from services.cli.stack import Stack, StackSettings
    from shared.settings import load_settings

    if settings is None:
        settings = load_settings(StackSettings)
    with tempfile.TemporaryDirectory(prefix="poise-stack-capture-") as tmp:
        settings = settings.model_copy(update={"run_dir": Path(tmp)})
        with _recording() as recorded:
            try:
                with (mock.patch.object(Stack, "_wait_ready", lambda self, engines: None),
                      mock.patch.object(Stack, "_write_state", lambda self: None)):
                    stack = Stack(settings)
                    stack._start()
            except AttributeError as exc:
                raise StackCaptureError(f"services/cli/stack.py changed: {exc}") from exc
    if not recorded:
        raise StackCaptureError("poise up started no process through ManagedProcess; services/cli/stack.py changed")
    return recorded


def clean_env() -> dict[str, str]:
    """The current environment without ``POISE_*`` variables (settings read them; a capture must not)."""
    return {k: v for k, v in os.environ.items() if not k.upper().startswith("POISE_")}


@contextlib.contextmanager
def environment(values: dict[str, str]) -> Iterator[None]:
    """Run with exactly ``values`` as ``os.environ``, restored afterwards: settings read the environment, so a
    capture (and a test of one) must choose what it sees, e.g. ``environment(clean_env())``."""
    saved = dict(os.environ)
    os.environ.clear()
    os.environ.update(values)
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(saved)
