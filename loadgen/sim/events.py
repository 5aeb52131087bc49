"""A discrete-event queue: events ordered by (time, priority, insertion order).

The sequence number comes from a counter the queue owns, so two runs with the same inputs pop events in
the same order (no dependence on object ids or hashing). Entries are plain tuples: the heap compares them
in C, which is most of what a simulation of a whole trace spends on its queue. Events known before the run
(a trace's arrivals, :meth:`EventQueue.preload`) wait in a sorted list beside the heap rather than in it: a
heap of a few dozen pending steps and transfers instead of every arrival of the hour, in the same order.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable, Iterable
from typing import Any

# Lower runs first at equal times: finish work before admitting arrivals, so an arrival sees freed capacity.
PRIORITY_STEP_END = 0
PRIORITY_TRANSFER_DONE = 1
PRIORITY_ARRIVAL = 2

_Entry = tuple[float, int, int, Callable[[], Any]]


class EventQueue:
    def __init__(self) -> None:
        self._heap: list[_Entry] = []
        self._seq = itertools.count()
        self._preloaded: list[_Entry] = []  # sorted, next last
        self.now_s = 0.0
        self.processed = 0

    def preload(self, events: Iterable[tuple[float, Callable[[], Any]]], priority: int) -> None:
        """Schedule ``events`` (time, action) at ``priority``, ordered as if each had been pushed with
        :meth:`at` before any other event (equal times and priorities run in the order given). Once per queue,
        before anything else is scheduled."""
        if self._preloaded or self._heap or self.processed:
            raise RuntimeError("preload comes once, before any other event")
        entries = list(events)
        n = len(entries)
        # Sequence numbers below every later push's (which count from 0), as the first n pushes would have had.
        loaded = [(time_s, priority, i - n, action) for i, (time_s, action) in enumerate(entries)]
        if loaded and min(loaded)[0] < self.now_s:
            raise ValueError(f"cannot schedule in the past: {min(loaded)[0]} < {self.now_s}")
        loaded.sort(reverse=True)
        self._preloaded = loaded

    def at(self, time_s: float, priority: int, action: Callable[[], Any]) -> None:
        if time_s < self.now_s:
            raise ValueError(f"cannot schedule in the past: {time_s} < {self.now_s}")
        heapq.heappush(self._heap, (time_s, priority, next(self._seq), action))

    def run(self) -> None:
        heap = self._heap
        pop = heapq.heappop
        loaded = self._preloaded
        while heap or loaded:
            if loaded and (not heap or loaded[-1] < heap[0]):
                time_s, _, _, action = loaded.pop()
            else:
                time_s, _, _, action = pop(heap)
            self.now_s = time_s
            self.processed += 1
            action()
