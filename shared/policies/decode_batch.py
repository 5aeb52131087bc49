"""Decode batch selection: which running requests take part in the next decode step.

A policy is pure: ``select(running, max_batch, now_s, kv_waiting)`` returns the requests to step now; the
others wait one step (their KV stays put). ``kv_waiting`` is how many requests wait on this engine for KV
(a policy that holds requests back also holds their KV). Items are read through :class:`DecodeItem`, so engines pass their own
request objects. A policy whose ``selects_all`` is True (continuous batching) is never called. After each
step the engine reports it with ``observe`` (Kairos keeps its step-time table current this way).

Imports nothing from asyncio, nats, aetcd, httpx or fastapi.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, TypeVar


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
    def slo_tpot_s(self) -> float: ...  # inf when the request carries no TPOT target


T = TypeVar("T", bound=DecodeItem)


class DecodeBatchPolicy(Protocol):
    name: str
    selects_all: bool  # True: every running request steps every time, and ``select`` need not be called

    def select(self, running: Sequence[T], max_batch: int, now_s: float, kv_waiting: int = 0) -> Sequence[T]: ...

    def observe(self, batch_size: int, max_context: int, total_context: int, seconds: float) -> None:
        """A decode step over ``batch_size`` requests (longest context ``max_context``, ``total_context`` in
        all) took ``seconds``."""
        ...


class Continuous:
    """Continuous batching: every running request decodes every step (SGLang, vLLM)."""

    name = "continuous"
    selects_all = True

    def select(self, running: Sequence[T], max_batch: int, now_s: float, kv_waiting: int = 0) -> Sequence[T]:
        return running[:max_batch]

    def observe(self, batch_size: int, max_context: int, total_context: int, seconds: float) -> None:
        return None
