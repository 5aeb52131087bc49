"""The held queue's one pump (``LateBinding.pump``), which the live gateway and the simulator both run: what it
refuses, what it places where, and when it asks to be woken."""

from __future__ import annotations

import math
from dataclasses import dataclass

from shared.latency import LatencyModel, load_profile
from shared.policies import make_prefill_policy
from shared.policies.late_binding import LateBinding
from shared.policies.views import EngineView

MODEL = LatencyModel(load_profile())


@dataclass(eq=False)
class Held:
    rid: str
    arrival_s: float
    slo_ttft_s: float = math.inf
    input_tokens: int = 1000
    prefilled: int = 0
    retries: int = 0


def decode(running: int, cap: int = 8) -> EngineView:
    return EngineView(instance_id="d0", role="decode", status="ready", kv_capacity_tokens=100_000,
                      max_running_requests=cap, running_reqs=running, waiting_reqs=0)


class Placer:
    """Places on the first prefill engine not excluded, as a dispatch policy with no preference would."""

    def __init__(self, engines: list[str]) -> None:
        self.engines = engines
        self.placed: list[tuple[str, str | None, frozenset[str]]] = []

    def __call__(self, item: Held, full: frozenset[str]) -> str | None:
        target = next((e for e in self.engines if e not in full), None)
        self.placed.append((item.rid, target, full))
        return target


def binding(guard: bool = False, depth: int = 2) -> LateBinding:
    return LateBinding(make_prefill_policy("edf", MODEL), depth=depth, guard_decode=guard)


def test_it_fills_the_free_slots_in_the_policys_order_and_keeps_the_rest() -> None:
    held = [Held("late-deadline", 0.0, 9.0), Held("early-deadline", 0.5, 1.0), Held("mid", 0.2, 4.0)]
    place = Placer(["p0", "p1"])
    out = binding(depth=2).pump(held, {"p0": 1, "p1": 2}, [], 1.0, place)
    assert [rid for rid, _, _ in place.placed] == ["early-deadline"]  # one free slot in all (p0's second)
    assert place.placed[0][1:] == ("p0", frozenset({"p1"}))  # p1 was full: named, so never chosen
    assert [h.rid for h in held] == ["late-deadline", "mid"] and out.refused == [] and math.isinf(out.wake_at_s)


def test_a_slot_taken_is_counted_before_the_next_prompt_is_placed() -> None:
    held = [Held(f"r{i}", 0.0, float(i + 1)) for i in range(4)]
    place = Placer(["p0", "p1"])
    binding(depth=1).pump(held, {"p0": 0, "p1": 0}, [], 0.0, place)
    assert [(rid, target) for rid, target, _ in place.placed] == [("r0", "p0"), ("r1", "p1")]
    assert [h.rid for h in held] == ["r2", "r3"]


def test_a_prompt_that_takes_no_prefill_slot_leaves_it_to_the_next() -> None:
    held = [Held("a", 0.0, 1.0), Held("b", 0.0, 2.0)]
    taken: list[str] = []

    def place(item: Held, full: frozenset[str]) -> str | None:
        taken.append(item.rid)
        return None if item.rid == "a" else "p0"  # a: refused by the dispatch policy

    binding(depth=1).pump(held, {"p0": 0}, [], 0.0, place)
    assert taken == ["a", "b"] and held == []


def test_with_the_guard_it_refuses_what_waited_out_its_target_and_wakes_for_the_next_give_up() -> None:
    held = [Held("gone", 0.0, 2.0), Held("soon", 1.0, 2.0), Held("never", 0.0)]
    place = Placer(["p0"])
    out = binding(guard=True).pump(held, {"p0": 2}, [decode(running=0)], 2.0, place)
    assert [h.rid for h in out.refused] == ["gone"]  # held exactly its target: refused
    assert out.wake_at_s == 3.0 and place.placed == []  # p0 holds two already; "soon" is due at 1 + 2
    again = binding(guard=True).pump(held, {"p0": 2}, [decode(running=0)], out.wake_at_s, place)
    assert [h.rid for h in again.refused] == ["soon"], "a wake-up at the given time finds the give-up due"


def test_with_the_guard_nothing_goes_while_no_decode_engine_could_start_it() -> None:
    held = [Held("a", 0.0, 5.0)]
    place = Placer(["p0"])
    out = binding(guard=True).pump(held, {"p0": 0}, [decode(running=8)], 1.0, place)
    assert place.placed == [] and [h.rid for h in held] == ["a"] and out.wake_at_s == 5.0
    binding(guard=True).pump(held, {"p0": 0}, [decode(running=7)], 1.0, place)
    assert [rid for rid, _, _ in place.placed] == ["a"]


def test_without_a_prefill_engine_every_held_prompt_is_placed_as_without_late_binding() -> None:
    held = [Held("a", 0.0), Held("b", 0.1)]
    place = Placer([])
    out = binding().pump(held, {}, [decode(running=8)], 0.0, place)
    assert [(rid, full) for rid, _, full in place.placed] == [("a", frozenset()), ("b", frozenset())]
    assert held == [] and out.refused == []


def test_a_policy_that_waits_is_woken_when_it_asked() -> None:
    """DOPD's length batching holds a short prompt back for company: the pump places nothing and asks to be
    woken when the prompt's hold expires, when the policy releases it."""
    policy = make_prefill_policy("dopd-length", MODEL)
    policy.set_forecast_isl(10_000)  # type: ignore[attr-defined]  # a 64-token prompt is short
    held = [Held("a", 0.0, 10.0, input_tokens=64)]
    place = Placer(["p0"])
    out = LateBinding(policy).pump(held, {"p0": 0}, [], 0.0, place)
    assert place.placed == [] and 0.0 < out.wake_at_s < 10.0
    LateBinding(policy).pump(held, {"p0": 0}, [], out.wake_at_s, place)
    assert [rid for rid, _, _ in place.placed] == ["a"]


def test_a_prompt_taken_while_an_earlier_one_was_placed_is_skipped() -> None:
    """A placement may hand control back to its caller, which pumps again (the simulator: a refusal retried at
    once): a prompt that pump took is not placed a second time, and the pump does not fail on it."""
    held = [Held("a", 0.0, 1.0), Held("b", 0.0, 2.0), Held("c", 0.0, 3.0)]
    placed: list[str] = []

    def place(item: Held, full: frozenset[str]) -> str | None:
        placed.append(item.rid)
        if item.rid == "a":
            held.remove(next(h for h in held if h.rid == "b"))  # taken by the inner pump
            placed.append("b")
        return None

    binding(depth=3).pump(held, {"p0": 0}, [], 0.0, place)
    assert placed == ["a", "b", "c"] and held == []


def test_a_fewest_late_policy_plans_the_held_queue_for_every_prefill_engine_it_feeds() -> None:
    """The held queue feeds all of a model's prefill engines: the 10K-token prompt that one engine would give up
    for the two short ones behind it (their deadlines are near) goes first when two engines are free."""
    def queue() -> list[Held]:
        return [Held("long", 0.0, 0.40, input_tokens=10_000), Held("b", 0.0, 0.42), Held("c", 0.0, 0.44)]

    policy = make_prefill_policy("flowprefill-fewest-late", MODEL)
    two, one = Placer(["p0", "p1"]), Placer(["p0"])
    LateBinding(policy, depth=1).pump(queue(), {"p0": 0, "p1": 0}, [], 0.0, two)
    LateBinding(policy, depth=2).pump(queue(), {"p0": 0}, [], 0.0, one)
    assert [rid for rid, _, _ in two.placed] == ["long", "b"]
    assert [rid for rid, _, _ in one.placed] == ["b", "c"]


def test_a_clients_retry_waits_behind_every_first_send() -> None:
    """The retry's client counts its TTFT from its first send: it goes after the first sends, although its new
    arrival gives it the earliest deadline, and in the policy's order among the retries once they are alone."""
    held = [Held("first-late", 0.0, 9.0), Held("retry", 0.5, 1.0, retries=1), Held("first", 0.2, 4.0),
            Held("retry-2", 0.6, 2.0, retries=2)]
    place = Placer(["p0"])
    binding(depth=3).pump(held, {"p0": 0}, [], 1.0, place)
    assert [rid for rid, _, _ in place.placed] == ["first", "first-late", "retry"]
    binding(depth=3).pump(held, {"p0": 2}, [], 1.0, place)
    assert [rid for rid, _, _ in place.placed][3:] == ["retry-2"] and held == []
