"""Output length predictors: how many tokens a running request still has to generate.

``predict_remaining(request, generated, true_total)`` is pure given the predictor's state; learning
predictors update that state only in ``observe`` (a finished request's true output length), which the
executor calls. ``true_total`` is the request's true output length where the caller knows it (the
simulator, from the trace); live callers leave it None, and only the simulator stand-ins (``oracle``,
``ares-noise``) need it. The simulator puts predictions into the snapshot's ``decode_requests`` for
migration policies to read, re-predicting every k decode steps and counting down in between (ARES §5.3,
``loadgen/sim/prediction.py``).

Imports nothing from asyncio, nats, aetcd, httpx or fastapi.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Callable
from statistics import NormalDist
from typing import Protocol

import msgspec

from shared.policies.context import lookup
from shared.policies.views import RequestView


class LengthPredictor(Protocol):
    name: str

    def predict_remaining(self, request: RequestView, generated: int, true_total: int | None = None) -> float: ...

    def observe(self, input_tokens: int, output_tokens: int) -> None: ...


class MaxTokens:
    """The client's ``max_tokens`` bound: what a scheduler knows with no predictor at all."""

    name = "max-tokens"

    def predict_remaining(self, request: RequestView, generated: int, true_total: int | None = None) -> float:
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

    def predict_remaining(self, request: RequestView, generated: int, true_total: int | None = None) -> float:
        if not self._count:
            return float(max(request.max_output_tokens - generated, 0))
        mean = self._total / self._count
        remaining = mean - generated if generated < mean else mean
        return float(min(remaining, max(request.max_output_tokens - generated, 0)))

    def observe(self, input_tokens: int, output_tokens: int) -> None:
        self._count += 1
        self._total += output_tokens


def _needs_truth(name: str, true_total: int | None) -> int:
    if true_total is None:
        raise ValueError(f"the {name!r} length predictor needs the true output length (a simulator stand-in)")
    return true_total


class Oracle:
    """The true remaining length (ARES-Oracle, spec §1.12.12): what a perfect predictor would say."""

    name = "oracle"

    def predict_remaining(self, request: RequestView, generated: int, true_total: int | None = None) -> float:
        return float(max(_needs_truth(self.name, true_total) - generated, 0))

    def observe(self, input_tokens: int, output_tokens: int) -> None:
        return None


class AresNoiseParams(msgspec.Struct, frozen=True, kw_only=True):
    """A stand-in for ARES' hidden-state MLP (spec §1.2): the truth, pulled toward a prior and blurred, both
    less as tokens are generated. Defaults are calibrated to ARES Fig. 7 (see :class:`AresNoise`)."""

    prior_tokens: float = 1536.0  # what a prompt-only guess regresses to: ShareGPT/R1-distill P50 output (§1.11)
    shrink0: float = 0.382  # share of the log-distance to the prior at 0 generated tokens
    sigma0: float = 1.0  # log-normal noise at 0 generated tokens
    sigma_floor: float = 0.244  # log-normal noise once the context says most of what it can
    decay_tokens: float = 2000.0  # shrink and the noise above the floor fall by e every this many tokens
    max_output_tokens: int = 32768  # ARES' generation cap: a prediction never exceeds cap - generated
    clamp_to_max_tokens: bool = False  # also cap by the request's max_tokens (off: in trace replays it IS the truth)
    seed: int = 0


class AresNoise:
    """Multiplicative log-normal error around the true remaining length, shrinking as tokens are generated.

    With y the true remaining length after g generated tokens, d = exp(-g / decay_tokens):

        log y_hat = (1 - shrink0 d) log y + shrink0 d log prior + (sigma_floor + (sigma0 - sigma_floor) d) Z

    clamped to [1, max_output_tokens - g]. The shrink toward the prior is why a prompt-only guess is poor for
    30K-token outputs (it says a few thousand: the paper's 18K MAE), the noise term the MLP's scatter.
    Z ~ N(0, 1) comes from a hash of (seed, rid, g): the same request at the same point gets the same
    prediction in every run and process; re-predicting every k steps makes g the prediction index.

    Calibration (requests whose true output is uniform in 30K-32K, as Fig. 7): MAE 18,256 tokens at g = 0
    and 2,929 at g = 8,000, the paper's two anchors (``tests/unit/test_ares_length.py`` holds it to 15%).
    Over every 20th token of ARES-like outputs (ShareGPT/R1: mean 7.5K, P50 1.5K, P90 32K) the MAE is about
    2.4K, below Table 1's 3,873 on the paper's own test set: this stand-in is a little kinder than the MLP.
    """

    name = "ares-noise"

    def __init__(self, params: AresNoiseParams | None = None) -> None:
        self.params = params or AresNoiseParams()
        self._normal = NormalDist()

    def _z(self, rid: str, generated: int) -> float:
        digest = hashlib.blake2b(f"{self.params.seed}|{rid}|{generated}".encode(), digest_size=8).digest()
        u = (int.from_bytes(digest, "big") + 0.5) / 2**64
        return self._normal.inv_cdf(u)

    def predict_remaining(self, request: RequestView, generated: int, true_total: int | None = None) -> float:
        p = self.params
        truth = max(_needs_truth(self.name, true_total) - generated, 1)
        decay = math.exp(-generated / p.decay_tokens)
        shrink = p.shrink0 * decay
        sigma = p.sigma_floor + (p.sigma0 - p.sigma_floor) * decay
        log_guess = (1 - shrink) * math.log(truth) + shrink * math.log(p.prior_tokens) + sigma * self._z(
            request.rid, generated)
        cap = p.max_output_tokens - generated
        if p.clamp_to_max_tokens:
            cap = min(cap, request.max_output_tokens - generated)
        return float(min(max(math.exp(log_guess), 1.0), max(cap, 1)))

    def observe(self, input_tokens: int, output_tokens: int) -> None:
        return None


LENGTH_PREDICTORS: dict[str, Callable[[], LengthPredictor]] = {
    MaxTokens.name: MaxTokens,
    HistoricalMean.name: HistoricalMean,
    Oracle.name: Oracle,
    AresNoise.name: AresNoise,
}


def counted_down(predicted: float, predicted_at: int, generated: int) -> float:
    """ARES' estimate between two predictions (spec §1.2.6 [REC]): the remaining length predicted at
    ``predicted_at`` generated tokens, less the tokens generated since, at least 1 (a request that outlives its
    prediction still has a token to go). The one copy of the rule: the gateway, the predictor service and the
    simulator all count down with it."""
    return max(1.0, predicted - (generated - predicted_at))


def make_length_predictor(name: str) -> LengthPredictor:
    return lookup(LENGTH_PREDICTORS, name, "length predictor")()
