"""Prefill ordering policies: which waiting prompt a prefill engine admits next (Kairos, FlowPrefill later).

A policy is pure: ``order(waiting, now_s)`` returns the waiting requests in the order the engine should
admit them. It reads items through the :class:`PrefillItem` protocol, so the simulator's requests and
engine_sim's requests are passed as they are, without copies. A policy whose ``reorders`` is False (FCFS)
is never called: the engine keeps arrival order at no cost.

Imports nothing from asyncio, nats, aetcd, httpx or fastapi.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol, TypeVar

from shared.policies.context import lookup


class PrefillItem(Protocol):
    """What an ordering policy may read about a waiting prompt."""

    @property
    def rid(self) -> str: ...
    @property
    def arrival_s(self) -> float: ...  # on the engine's clock, the same one as ``now_s``
    @property
    def input_tokens(self) -> int: ...
    @property
    def prefilled(self) -> int: ...  # prompt tokens already computed (chunked prefill)
    @property
    def slo_ttft_s(self) -> float: ...


T = TypeVar("T", bound=PrefillItem)


class PrefillOrderPolicy(Protocol):
    name: str
    reorders: bool  # False: arrival order, and ``order`` need not be called

    def order(self, waiting: Sequence[T], now_s: float) -> list[T]: ...


class Fcfs:
    """Arrival order (SGLang's default ``fcfs`` schedule policy for a prefill engine without a prefix cache)."""

    name = "fcfs"
    reorders = False

    def order(self, waiting: Sequence[T], now_s: float) -> list[T]:
        return list(waiting)


class Edf:
    """Earliest TTFT deadline first (arrival + the request's TTFT SLO); ties by arrival, then rid."""

    name = "edf"
    reorders = True

    def order(self, waiting: Sequence[T], now_s: float) -> list[T]:
        return sorted(waiting, key=lambda r: (r.arrival_s + r.slo_ttft_s, r.arrival_s, r.rid))


PREFILL_ORDER_POLICIES: dict[str, Callable[[], PrefillOrderPolicy]] = {Fcfs.name: Fcfs, Edf.name: Edf}


def make_prefill_order_policy(name: str) -> PrefillOrderPolicy:
    return lookup(PREFILL_ORDER_POLICIES, name, "prefill order policy")()
