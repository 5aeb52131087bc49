"""How much of this machine the main job can have, and what to make of a run the machine could not keep up with.

``poise run`` replays a trace slice at a fixed rate on engine_sim stand-ins: on a laptop with other work
running, the load generator and the stand-ins fall behind the trace's clock, and the attainment then measures
the neighbours, not Poise. Before the stack comes up the job samples how many other tasks want a core; when
some do, it replays at a rate cut in proportion to the cores left (``paced_rate``), and says so. After the
replay, ``verdict`` reads the load generator's own lateness and tells apart what the machine did from what
Poise did: only a failure that is Poise's (an error answer, a broken stream) fails the command.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass

from loadgen.records import RequestRecord
from shared.protocol.refusal import REFUSAL_STATUSES

#: The fewest other runnable tasks, on average, that count as a busy machine.
BUSY_TASKS = 0.5
#: The lowest share of the asked-for rate a busy machine is given (a saturated box still gets a run).
MIN_RATE_SHARE = 0.25
#: Load-generator lateness (p99) past which the machine, not the stack, set the pace.
LATE_P99_S = 1.0


@dataclass(frozen=True, slots=True)
class Headroom:
    cores: int
    busy: float  # other tasks that wanted a core, on average over the sample

    @property
    def free_share(self) -> float:
        return max(0.0, self.cores - self.busy) / self.cores


def _running_tasks() -> int | None:
    """Runnable tasks right now, this one included (/proc/loadavg's fourth field); None off Linux."""
    try:
        with open("/proc/loadavg") as f:
            return int(f.read().split()[3].split("/")[0])
    except (OSError, IndexError, ValueError):
        return None


def sample_headroom(seconds: float = 1.0, samples: int = 20) -> Headroom:
    """The machine's cores and how many other tasks wanted one, sampled over ``seconds``; the 1-minute load
    average where the instantaneous count is not available."""
    cores = os.cpu_count() or 1
    counts: list[int] = []
    for _ in range(samples):
        n = _running_tasks()
        if n is None:
            break
        counts.append(n - 1)  # the reader itself is running
        time.sleep(seconds / samples)
    if counts:
        return Headroom(cores, sum(counts) / len(counts))
    return Headroom(cores, os.getloadavg()[0] if hasattr(os, "getloadavg") else 0.0)


def paced_rate(rate: float, headroom: Headroom) -> float:
    """The replay rate for this machine: ``rate`` when it is free, cut in proportion to the cores left when
    other work holds some, never below ``MIN_RATE_SHARE`` of it."""
    if headroom.busy < BUSY_TASKS:
        return rate
    return rate * max(MIN_RATE_SHARE, min(1.0, headroom.free_share))


@dataclass(frozen=True, slots=True)
class Verdict:
    machine_behind: bool  # the load generator could not send on time: the machine set the pace
    poise_failures: int  # error answers and broken streams: Poise's to fix
    refused: int  # 429/503 the client gave up on after its retries: the service shedding load
    line: str | None  # what to tell the user, when there is something to tell

    @property
    def failed(self) -> bool:
        return self.poise_failures > 0


def verdict(records: list[RequestRecord], lateness_p99_s: float | None, *, rate: float) -> Verdict:
    """What a finished replay says about Poise and about the machine it ran on."""
    behind = lateness_p99_s is not None and lateness_p99_s > LATE_P99_S
    failed = [r for r in records if not r.ok]
    refused = sum(r.http_status in REFUSAL_STATUSES for r in failed)
    # A timeout or a reset on a machine that could not keep up is the machine's; an error status is Poise's.
    ours = sum(r.http_status not in REFUSAL_STATUSES and (r.http_status is not None or not behind) for r in failed)
    line = None
    if behind:
        line = (f"this machine fell behind: the load generator sent requests up to {lateness_p99_s:.1f}s late (p99), "
                "so the attainment above measures the machine's other work, not Poise; run it on an idle machine, "
                f"or at a lower rate (--rate-scale {rate / 2:g})")
    elif refused:
        line = f"{refused} requests were refused after the client's retries (429/503: the service shedding load)"
    return Verdict(machine_behind=behind, poise_failures=ours, refused=refused, line=line)
