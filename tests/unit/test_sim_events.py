"""The simulator's event queue: time, then priority, then the order of scheduling; preloaded events as if
they had been scheduled first."""

from __future__ import annotations

import pytest

from loadgen.sim.events import PRIORITY_ARRIVAL, PRIORITY_STEP_END, EventQueue


def _recorder(queue: EventQueue, log: list[tuple[str, float]]):  # type: ignore[no-untyped-def]
    def make(name: str):  # type: ignore[no-untyped-def]
        return lambda: log.append((name, queue.now_s))
    return make


def test_events_run_by_time_then_priority_then_scheduling_order() -> None:
    q = EventQueue()
    log: list[tuple[str, float]] = []
    ev = _recorder(q, log)
    q.at(2.0, PRIORITY_ARRIVAL, ev("late"))
    q.at(1.0, PRIORITY_ARRIVAL, ev("arrival-a"))
    q.at(1.0, PRIORITY_STEP_END, ev("step"))
    q.at(1.0, PRIORITY_ARRIVAL, ev("arrival-b"))
    q.run()
    assert log == [("step", 1.0), ("arrival-a", 1.0), ("arrival-b", 1.0), ("late", 2.0)]
    assert q.processed == 4


def _preloaded_vs_pushed(preload: bool) -> list[tuple[str, float]]:
    q = EventQueue()
    log: list[tuple[str, float]] = []
    ev = _recorder(q, log)
    arrivals = [(0.5, ev("a0")), (1.0, ev("a1")), (1.0, ev("a2")), (3.0, ev("a3"))]
    if preload:
        q.preload(arrivals, PRIORITY_ARRIVAL)
    else:
        for t, action in arrivals:
            q.at(t, PRIORITY_ARRIVAL, action)

    def tick() -> None:  # a control tick at the arrivals' priority, rescheduling itself, and a step end
        log.append(("tick", q.now_s))
        if q.now_s < 3.0:
            q.at(q.now_s + 1.0, PRIORITY_ARRIVAL, tick)
            q.at(q.now_s + 0.5, PRIORITY_STEP_END, ev("step"))

    q.at(0.0, PRIORITY_ARRIVAL, tick)
    q.run()
    return log


def test_preloaded_events_run_as_if_scheduled_before_everything_else() -> None:
    # Ties at equal time and priority (the ticks at 1.0 and 3.0) must go the way they went when every arrival
    # was pushed first: the arrival before the tick.
    pushed = _preloaded_vs_pushed(preload=False)
    assert _preloaded_vs_pushed(preload=True) == pushed
    assert pushed.index(("a2", 1.0)) < pushed.index(("tick", 1.0))
    assert pushed.index(("a3", 3.0)) < pushed.index(("tick", 3.0))


def test_preload_comes_first_and_never_in_the_past() -> None:
    q = EventQueue()
    q.at(1.0, PRIORITY_STEP_END, lambda: None)
    with pytest.raises(RuntimeError, match="once, before any other event"):
        q.preload([(2.0, lambda: None)], PRIORITY_ARRIVAL)
    q.run()
    with pytest.raises(RuntimeError):
        q.preload([(2.0, lambda: None)], PRIORITY_ARRIVAL)  # after a run, too
    fresh = EventQueue()
    fresh.now_s = 5.0
    with pytest.raises(ValueError, match="in the past"):
        fresh.preload([(1.0, lambda: None)], PRIORITY_ARRIVAL)
