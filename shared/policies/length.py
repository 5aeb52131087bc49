"""Output length predictors: how many tokens a running request still has to generate (ARES later).

``predict_remaining(request, generated)`` is pure given the predictor's state; learning predictors update
that state only in ``observe`` (a finished request's true output length), which the executor calls. The
simulator puts predictions into the snapshot's ``decode_requests`` for migration policies to read.

Imports nothing from asyncio, nats, aetcd, httpx or fastapi.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

from shared.policies.context import lookup
from shared.policies.views import RequestView


class LengthPredictor(Protocol):
    name: str

    def predict_remaining(self, request: RequestView, generated: int) -> float: ...

    def observe(self, input_tokens: int, output_tokens: int) -> None: ...


class MaxTokens:
    """The client's ``max_tokens`` bound: what a scheduler knows with no predictor at all."""

    name = "max-tokens"

    def predict_remaining(self, request: RequestView, generated: int) -> float:
        return float(max(request.max_output_tokens - generated, 0))

    def observe(self, input_tokens: int, output_tokens: int) -> None:
        return None


class HistoricalMean:
    """Mean output length of finished requests, less what was generated, capped by ``max_tokens``.

    Before anything finished it falls back to ``max_tokens``. A request that already outlived the mean is
    given one mean more: heavy tails make a long request likely to stay long.
    """

    name = "historical-mean"

    def __init__(self) -> None:
        self._count = 0
        self._total = 0

    def predict_remaining(self, request: RequestView, generated: int) -> float:
        if not self._count:
            return float(max(request.max_output_tokens - generated, 0))
        mean = self._total / self._count
        remaining = mean - generated if generated < mean else mean
        return float(min(remaining, max(request.max_output_tokens - generated, 0)))

    def observe(self, input_tokens: int, output_tokens: int) -> None:
        self._count += 1
        self._total += output_tokens


LENGTH_PREDICTORS: dict[str, Callable[[], LengthPredictor]] = {
    MaxTokens.name: MaxTokens,
    HistoricalMean.name: HistoricalMean,
}


def make_length_predictor(name: str) -> LengthPredictor:
    return lookup(LENGTH_PREDICTORS, name, "length predictor")()
