"""engine_sim's clock: the time its scheduler plans steps by, waits on, and stamps latencies with.

``time.monotonic`` unless a test drives it from its event loop (:func:`driven_by`): then a loop with virtual
time (``looptime``) runs the engine without waiting, its steps, timeouts and waits in the order real time would
have them. Production keeps ``time.monotonic``: uvloop's loop time is cached per iteration at millisecond
resolution, too coarse for the latency stamps."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable, Iterator

_source: Callable[[], float] = time.monotonic


def monotonic() -> float:
    return _source()


def unix() -> float:
    """Wall-clock time advancing with :func:`monotonic`: the stamps an engine reports as Unix times, such as
    its load snapshot's."""
    return time.time() - time.monotonic() + _source()


def loop_time() -> float:
    """The running event loop's time (``time.monotonic`` outside a loop): a source for :func:`driven_by`."""
    try:
        return asyncio.get_running_loop().time()
    except RuntimeError:
        return time.monotonic()


@contextlib.contextmanager
def driven_by(source: Callable[[], float]) -> Iterator[None]:
    global _source
    previous, _source = _source, source
    try:
        yield
    finally:
        _source = previous
