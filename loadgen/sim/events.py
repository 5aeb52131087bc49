"""A discrete-event queue: events ordered by (time, priority, insertion order).

The sequence number comes from a counter the queue owns, so two runs with the same inputs pop events in
the same order (no dependence on object ids or hashing). Entries are plain tuples: the heap compares them
in C, which is most of what a simulation of a whole trace spends on its queue.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable
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
        self.now_s = 0.0
        self.processed = 0

    def at(self, time_s: float, priority: int, action: Callable[[], Any]) -> None:
        if time_s < self.now_s:
            raise ValueError(f"cannot schedule in the past: {time_s} < {self.now_s}")
        heapq.heappush(self._heap, (time_s, priority, next(self._seq), action))

    def run(self) -> None:
        heap = self._heap
        pop = heapq.heappop
        while heap:
            time_s, _, _, action = pop(heap)
            self.now_s = time_s
            self.processed += 1
            action()
