"""The processes ``poise up`` starts, listed without starting any: the reference the docker-compose dev stack
(``deploy/docker-compose.yml``) is checked against.

:func:`poise_up_processes` asks the stack for the processes it would start (:meth:`Stack.planned`: the same
code as ``poise up``, with every process described, not started), so a flag ``poise up`` adds or drops shows
up here.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any


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


def poise_up_processes(settings: Any = None) -> list[StackProcess]:
    """Every process ``poise up`` starts, in order, for ``settings`` (default: read as ``poise up`` reads them).

    Ports that ``poise up`` takes free at start are whatever was free now; compare them as "a port".
    """
    from services.cli.stack import Stack, StackSettings
    from shared.settings import load_settings

    if settings is None:
        settings = load_settings(StackSettings)
    with tempfile.TemporaryDirectory(prefix="poise-stack-capture-") as tmp:
        planned = Stack(settings.model_copy(update={"run_dir": Path(tmp)})).planned()
    return [StackProcess(name=p.name, argv=tuple(str(a) for a in p.args), env=_given(p.env)) for p in planned]


def _given(env: dict[str, str] | None) -> tuple[tuple[str, str], ...]:
    """The POISE_* variables ``poise up`` sets for a process (those it inherits are not its)."""
    return tuple(sorted((k, v) for k, v in (env or {}).items() if k.startswith("POISE_") and os.environ.get(k) != v))


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
