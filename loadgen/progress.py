"""Live progress of a running replay: the snapshot type and a terminal printer.

Owns `ReplayProgress` (what the replay reports about once a second) and
`print_progress`, the default one-line status display on stderr, so long
benchmark runs show they are alive and whether the server keeps up.
"""

from __future__ import annotations

import sys
from typing import TextIO

import msgspec

_LINE_WIDTH = 100


class ReplayProgress(msgspec.Struct, frozen=True):
    """A snapshot of a running replay. ``final`` is set on the last report."""

    total: int
    sent: int
    done: int
    failed: int
    in_flight: int
    elapsed_s: float
    ttft_p50_s: float | None
    final: bool = False


def format_progress(p: ReplayProgress) -> str:
    ttft = "-" if p.ttft_p50_s is None else f"{p.ttft_p50_s * 1000:.0f}ms"
    return (
        f"[{p.elapsed_s:7.1f}s] sent {p.sent}/{p.total}  done {p.done}  failed {p.failed}  "
        f"in-flight {p.in_flight}  p50 TTFT {ttft}"
    )


def print_progress(p: ReplayProgress, stream: TextIO | None = None) -> None:
    """Rewrite one status line on a terminal; in a log (not a TTY) write a line every 10 s and at the end."""
    out = stream if stream is not None else sys.stderr
    line = format_progress(p)
    if not out.isatty():
        # A carriage-return line in a CI log is one endless line; keep logs readable and short.
        if p.final or int(p.elapsed_s) % 10 == 0:
            out.write(line + "\n")
            out.flush()
        return
    # Pad instead of an ANSI erase so a line that got shorter leaves no stale characters.
    out.write("\r" + line.ljust(_LINE_WIDTH) + ("\n" if p.final else ""))
    out.flush()
