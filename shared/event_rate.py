"""How often something happened recently: a count of events over a sliding window, per second.

Pure and synchronous (the caller passes the time), so the gateway drives it with its monotonic clock and the
simulator with virtual time. The dispatcher keeps one per engine for the requests it saw leave that engine
(:class:`shared.policies.admission.EarlyRejection` reads it as the engine's service rate).
"""

from __future__ import annotations

from collections import deque


class EventRate:
    """Events per second over the last ``window_s``; None until ``min_events`` fell inside the window, so a
    rate read off one or two events (an engine that just started, or that has been idle) is not trusted."""

    __slots__ = ("window_s", "min_events", "_times")

    def __init__(self, window_s: float = 30.0, min_events: int = 8) -> None:
        if window_s <= 0:
            raise ValueError("window_s must be > 0")
        if min_events < 1:
            raise ValueError("min_events must be >= 1")
        self.window_s = window_s
        self.min_events = min_events
        self._times: deque[float] = deque()

    def record(self, now_s: float) -> None:
        self._times.append(now_s)
        self._expire(now_s)

    def rate(self, now_s: float) -> float | None:
        self._expire(now_s)
        if len(self._times) < self.min_events:
            return None
        return len(self._times) / self.window_s

    def _expire(self, now_s: float) -> None:
        times = self._times
        cutoff = now_s - self.window_s
        while times and times[0] <= cutoff:
            times.popleft()
