"""Late binding of prompts to prefill engines, for engines whose scheduler cannot be patched (stock SGLang).

The gateway holds requests in its own queue and releases one to a prefill engine only when that engine has
fewer than ``depth`` prompts sent and not yet prefilled, so the order in which prompts reach the engines is
the prefill policy's order (Kairos, FlowPrefill, EDF, ...) instead of arrival order. What it cannot do is
preempt: a prompt already on an engine runs there. The simulator uses this same object for its
``late-binding`` mixes, to measure how much of the engine-level gain it keeps. On a disaggregated cluster it
also keeps decode KV for prompts about to be prefilled: SGLang's decode side reserves a request's KV at
dispatch, so a prompt sent on arrival holds it through its whole prefill queue wait (docs/engine-scheduling.md).

Pure and clock-free: the caller owns the held requests, reads the engines and passes the time. The held queue's
one pump (:meth:`LateBinding.pump`) is what the live gateway (services/gateway/late_binding.py, an asyncio
adapter) and the simulator (loadgen/sim/cluster.py, an event-queue adapter) both run, so the order prompts are
released in, the refusals and the wake-ups are the same rule in both.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Generic, Protocol, TypeVar

from shared.policies.prefill_order import PlansForServers, PrefillItem, PrefillPolicy
from shared.policies.views import EngineView


class HeldItem(PrefillItem, Protocol):
    """A held prompt: what a prefill policy reads, and how many times its client sent it before."""

    @property
    def retries(self) -> int: ...  # 0 on a first send (the OpenAI clients' X-Stainless-Retry-Count)


T = TypeVar("T", bound=HeldItem)

#: The budget handed to the policy: large enough that every held prompt fits (the gateway plans an order,
#: not a forward pass).
_UNBOUNDED = 1 << 40

#: Prompts a prefill engine may hold unprefilled: one queued behind the running pass, so live, where the next
#: release is a network hop away, a pass's end finds the next prompt on the engine already.
DEFAULT_DEPTH = 2


def replica_depth(depth: int, replicas: int) -> int:
    """Each of ``replicas`` gateways' share of an engine's ``depth``: a gateway counts only the prompts it sent
    itself, so replicas that each held ``depth`` would let an engine hold ``replicas x depth`` unprefilled
    (and their decode KV). At least one each, so with more replicas than ``depth`` the engine may hold one per
    replica."""
    if depth < 1 or replicas < 1:
        raise ValueError(f"depth and replicas must be >= 1, got {depth} and {replicas}")
    return max(1, depth // replicas)


#: Places one released prompt, never on the prefill engines named (they have no slot left); returns the prefill
#: engine it took a slot on, or None (refused, placed on a colocated engine or prefilled on its decode engine).
PlaceFn = Callable[[T, frozenset[str]], "str | None"]


@dataclass(slots=True)
class Pumped(Generic[T]):
    """What one pump of the held queue did, besides the placements its ``place`` made."""

    refused: list[T] = field(default_factory=list)  # held past their TTFT target: refuse with give_up_reason
    wake_at_s: float = math.inf  # pump again then (a policy that chose to wait, the next give-up); inf: no need


@dataclass(slots=True)
class LateBinding:
    policy: PrefillPolicy
    depth: int = DEFAULT_DEPTH  # prompts an engine may hold unprefilled before the gateway stops sending it more
    # Guard the decode side, as early rejection does (on with it): release nothing while no decode engine could
    # start one more request, and refuse a held prompt once it has waited its whole TTFT target. Released on
    # prefill room alone, past the decode side's capacity prompts are prefilled, hold their decode KV and wait
    # for a running slot, a backlog early rejection does not judge (it judges the queue waiting for KV), and
    # every request starts late; held instead, the queue would grow for as long as the overload lasts.
    guard_decode: bool = False
    # Whether ``policy`` plans for several engines (asked once: the pump runs on every prefill's end).
    _spreads: bool = field(init=False, default=False)

    def __post_init__(self) -> None:
        if self.depth < 1:
            raise ValueError(f"late-binding depth must be >= 1, got {self.depth}")
        self._spreads = isinstance(self.policy, PlansForServers)

    def overdue(self, held: Sequence[T], now_s: float) -> list[T]:
        """The held prompts to refuse now: with ``guard_decode``, those that waited past their TTFT target."""
        if not self.guard_decode:
            return []
        # The same sum as the pump's wake-up for the next give-up, so a wake-up at that time finds it due.
        return [h for h in held if now_s >= h.arrival_s + h.slo_ttft_s]

    @staticmethod
    def give_up_reason(held_s: float, slo_ttft_s: float) -> str:
        """What a request refused by :meth:`overdue` is told (with early rejection's retryable 429)."""
        return (f"early rejection: held {held_s:.1f} s in the gateway, past its TTFT target of {slo_ttft_s:.1f} s; "
                f"retry later")

    def decode_room(self, engines: Sequence[EngineView]) -> bool:
        """Whether a prompt may be released now: always without ``guard_decode``; with it, while some accepting
        decode engine runs and queues fewer requests than its cap (or there is none to guard)."""
        if not self.guard_decode:
            return True
        decode = [e for e in engines if e.role == "decode" and e.accepting]
        return not decode or any(e.running_reqs + e.waiting_reqs < e.max_running_requests for e in decode)

    def free_slots(self, unprefilled: int) -> int:
        """How many more prompts an engine holding ``unprefilled`` prompts may get now."""
        return max(0, self.depth - unprefilled)

    def release(self, held: Sequence[T], slots: int, now_s: float, servers: int = 1) -> tuple[list[T], float | None]:
        """The held prompts to send now (at most ``slots``, in the policy's order, planned for the ``servers``
        prefill engines the queue feeds) and, when the policy chose to wait although slots are free, when to
        ask again.

        A client's retry waits behind every first send held: its client counts the TTFT from its first send,
        so the retry of a prompt refused at its target cannot make it, and ranked by the deadline its new
        arrival gives it, it would take the slot of a prompt that still can."""
        if slots <= 0 or not held:
            return [], None
        first = [h for h in held if h.retries == 0]
        if first:
            held = first
        if servers > 1 and self._spreads:
            plan = self.policy.plan_for(held, _UNBOUNDED, now_s, servers)  # type: ignore[attr-defined]
        else:
            plan = self.policy.plan(held, _UNBOUNDED, now_s)
        out: list[T] = []
        for item, _ in plan.parts:
            if len(out) >= slots:
                break
            out.append(item)
        return out, plan.retry_at_s

    def pump(self, held: list[T], prefill: Mapping[str, int] | None, decode: Sequence[EngineView], now_s: float,
             place: PlaceFn[T]) -> Pumped[T]:
        """Release what may go now, refusing what waited too long, and say when to look again.

        ``held``: the queue, in arrival order; the pump removes what it refuses or places. ``prefill``: the
        accepting prefill engines' unprefilled prompts from this queue, by instance id (empty or None: nothing to
        bind to, so every held prompt is placed as without late binding: a colocated engine, or the dispatch
        policy's error). ``decode``: the engines :meth:`decode_room` judges. ``place``: places one prompt and
        takes its engines' slots in the same step, so the next decision reads exact counts.
        """
        out: Pumped[T] = Pumped(refused=self.overdue(held, now_s))
        if out.refused:
            gone = {id(h) for h in out.refused}
            held[:] = [h for h in held if id(h) not in gone]
        if not prefill:
            while held:
                place(held.pop(0), frozenset())
            return out
        if held and self.guard_decode:
            out.wake_at_s = min(h.arrival_s + h.slo_ttft_s for h in held)  # the next give-up (inf: none)
        if not held or not self.decode_room(decode):
            return out  # a request that ends frees decode room and pumps again
        free = {instance_id: self.free_slots(n) for instance_id, n in prefill.items()}
        # Until the slots are taken or the policy holds the rest. A policy may release fewer than the free slots
        # (FlowPrefill's batch), and a prompt refused or prefilled on its decode engine takes none.
        while held:
            released, retry_at_s = self.release(held, sum(free.values()), now_s, len(free))
            if retry_at_s is not None:
                out.wake_at_s = min(out.wake_at_s, retry_at_s)
            if not released:
                break
            for item in released:
                if not any(h is item for h in held):
                    continue  # gone while an earlier one was placed (a caller's re-entrant pump took it)
                held.remove(item)
                taken = place(item, frozenset(i for i, n in free.items() if n <= 0))
                if taken is not None and taken in free:
                    free[taken] -= 1
        return out
