"""Decode batch selection: which running requests take part in the next decode step (Kairos later).

A policy is pure: ``select(running, max_batch, now_s)`` returns the requests to step now; the others wait
one step (their KV stays put). Items are read through :class:`DecodeItem`, so engines pass their own
request objects. A policy whose ``selects_all`` is True (continuous batching) is never called.

Imports nothing from asyncio, nats, aetcd, httpx or fastapi.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol, TypeVar

from shared.policies.context import lookup


class DecodeItem(Protocol):
    """What a batch selection policy may read about a running request."""

    @property
    def rid(self) -> str: ...
    @property
    def input_tokens(self) -> int: ...
    @property
    def generated(self) -> int: ...  # output tokens emitted so far
    @property
    def first_token_s(self) -> float | None: ...  # on the engine's clock
    @property
    def slo_tpot_s(self) -> float: ...


T = TypeVar("T", bound=DecodeItem)


class DecodeBatchPolicy(Protocol):
    name: str
    selects_all: bool  # True: every running request steps every time, and ``select`` need not be called

    def select(self, running: Sequence[T], max_batch: int, now_s: float) -> Sequence[T]: ...


class Continuous:
    """Continuous batching: every running request decodes every step (SGLang, vLLM)."""

    name = "continuous"
    selects_all = True

    def select(self, running: Sequence[T], max_batch: int, now_s: float) -> Sequence[T]:
        return running[:max_batch]


DECODE_BATCH_POLICIES: dict[str, Callable[[], DecodeBatchPolicy]] = {Continuous.name: Continuous}


def make_decode_batch_policy(name: str) -> DecodeBatchPolicy:
    return lookup(DECODE_BATCH_POLICIES, name, "decode batch policy")()
