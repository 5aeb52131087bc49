"""Runs the pool policy's ``decide`` off the event loop, one call at a time, and times every call.

DOPD's decision fits ARIMA models (tens to hundreds of ms, tests/bench/forecast_latency.py): on the event
loop that would stall the planner's NATS traffic, admin answers and running role commands. So ``decide``
runs on a dedicated single-thread executor. One thread, not ``asyncio.to_thread``'s shared pool, because
policies keep state between calls and are not thread-safe: calls must never overlap, also not when a tick
is cancelled while its call is still running (the thread finishes it; the next call queues behind it).
"""

from __future__ import annotations

import asyncio
import math
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Generic, Protocol, TypeVar

from shared.protocol import ClusterSnapshot

T = TypeVar("T")
T_co = TypeVar("T_co", covariant=True)


class _Deciding(Protocol[T_co]):
    """A pool policy (-> PoolDecision) or a scaling policy (-> ScalingTarget)."""

    def decide(self, snapshot: ClusterSnapshot, now_s: float) -> T_co | None: ...


def quantile(sorted_values: list[float], q: float) -> float:
    """Linear-interpolated quantile (numpy's default) of already sorted values; ``q`` in [0, 1]."""
    if not sorted_values:
        return math.nan
    pos = q * (len(sorted_values) - 1)
    lo = int(pos)
    hi = min(lo + 1, len(sorted_values) - 1)
    return sorted_values[lo] + (sorted_values[hi] - sorted_values[lo]) * (pos - lo)


class Decider(Generic[T]):
    """``await decider.decide(snapshot, now_s)``: the policy's answer, computed on the decider thread."""

    THREAD_NAME = "planner-decide"

    def __init__(self, policy: _Deciding[T], *, window: int = 500) -> None:
        self.policy = policy
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix=self.THREAD_NAME)
        if hasattr(policy, "forecaster") or hasattr(policy, "dopd"):
            from shared.forecast import preload

            self._executor.submit(preload)  # statsmodels' import would otherwise land in the first decision
        self.times_s: deque[float] = deque(maxlen=window)  # wall seconds of the latest decisions
        self.cpu_s: deque[float] = deque(maxlen=window)  # the decider thread's CPU seconds for each of them
        self.count = 0

    async def decide(self, snapshot: ClusterSnapshot, now_s: float) -> T | None:
        loop = asyncio.get_running_loop()
        decision, wall_s, cpu_s = await loop.run_in_executor(self._executor, self._timed, snapshot, now_s)
        self.times_s.append(wall_s)
        self.cpu_s.append(cpu_s)
        self.count += 1
        return decision

    def _timed(self, snapshot: ClusterSnapshot, now_s: float) -> tuple[T | None, float, float]:
        # Timed on the thread: the policy's own cost, not the wait for the loop to pick the result up. Wall
        # time is what the planner waits; CPU time tells the policy's cost from a busy machine's interference.
        t0, c0 = time.perf_counter(), time.thread_time()
        decision = self.policy.decide(snapshot, now_s)
        return decision, time.perf_counter() - t0, time.thread_time() - c0

    def stats(self) -> dict[str, Any]:
        """p50 / p99 / max / last of the latest ``window`` decisions (wall, and CPU), in ms (None before any)."""
        times, cpu = sorted(self.times_s), sorted(self.cpu_s)
        if not times:
            return {"decisions": self.count, "window": 0, "p50_ms": None, "p99_ms": None, "max_ms": None,
                    "last_ms": None, "cpu_p50_ms": None, "cpu_p99_ms": None, "cpu_max_ms": None}
        return {"decisions": self.count, "window": len(times), "p50_ms": quantile(times, 0.5) * 1e3,
                "p99_ms": quantile(times, 0.99) * 1e3, "max_ms": times[-1] * 1e3, "last_ms": self.times_s[-1] * 1e3,
                "cpu_p50_ms": quantile(cpu, 0.5) * 1e3, "cpu_p99_ms": quantile(cpu, 0.99) * 1e3,
                "cpu_max_ms": cpu[-1] * 1e3}

    def close(self) -> None:
        # No waiting here: this runs on the event loop, and a running fit finishes on its own thread.
        self._executor.shutdown(wait=False, cancel_futures=True)
