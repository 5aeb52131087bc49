"""A small open-loop HTTP load client for the benchmarks: Poisson arrivals, per-request latency."""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field
from typing import Any

import orjson

from shared.http1 import Http1Pool


@dataclass
class Phase:
    """Latencies of one (target, rate) run."""

    target: str
    rate_rps: float
    latencies_s: list[float] = field(default_factory=list)
    errors: int = 0
    sent: int = 0
    late_s: list[float] = field(default_factory=list)  # how late each send was (client saturation)
    wall_s: float = 0.0


def percentile(values: list[float], p: float) -> float:
    if not values:
        return float("nan")
    s = sorted(values)
    k = (len(s) - 1) * p / 100
    lo, hi = int(k), min(int(k) + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


async def open_loop(url: str, body: dict[str, object], *, rate_rps: float, duration_s: float, target: str,
                    seed: int = 0, warmup: int = 20, grace_s: float = 10.0) -> Phase:
    """Send at ``rate_rps`` for ``duration_s``; requests still open ``grace_s`` later count as errors
    (a saturated server would otherwise keep a phase going for as long as its queue takes to drain)."""
    phase = Phase(target=target, rate_rps=rate_rps)
    rng = random.Random(seed)
    # The client uses the same lean HTTP/1.1 pool as the gateway: with httpx it spent about a millisecond of CPU
    # per request, which on two cores starves the servers it is measuring.
    client = Http1Pool()
    payload = orjson.dumps(body)
    try:
        for _ in range(warmup):  # open connections and warm both servers before measuring
            await client.post_json(url, payload)

        async def one(at: float) -> None:
            phase.late_s.append(time.monotonic() - at)
            t0 = time.monotonic()
            try:
                status, _ = await asyncio.wait_for(client.post_json(url, payload), 30.0)
                ok = status == 200
            except OSError:
                ok = False
            if ok:
                phase.latencies_s.append(time.monotonic() - t0)
            else:
                phase.errors += 1

        await poisson_arrivals(one, phase, rate_rps=rate_rps, duration_s=duration_s, grace_s=grace_s, rng=rng)
    finally:
        await client.aclose()
    return phase


async def poisson_arrivals(one: Callable[[float], Coroutine[Any, Any, None]], phase: Any, *, rate_rps: float, duration_s: float,
                           grace_s: float, rng: random.Random) -> None:
    """Call ``one(scheduled_time)`` at Poisson arrivals for ``duration_s`` (open loop: never waits for answers),
    then give the stragglers ``grace_s``; a request still running then counts as an error. ``phase`` gets
    ``sent``, ``errors`` and ``wall_s``."""
    tasks: list[asyncio.Task[None]] = []
    start = time.monotonic()
    t = 0.0
    while t < duration_s:
        t += rng.expovariate(rate_rps)
        delay = start + t - time.monotonic()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.create_task(one(start + t)))
        phase.sent += 1
    _, pending = await asyncio.wait(tasks, timeout=max(0.0, start + duration_s + grace_s - time.monotonic()))
    for task in pending:
        task.cancel()
    phase.errors += len(pending)
    phase.wall_s = time.monotonic() - start
