"""What a profiling run measured, in engine seconds (wall seconds divided by the engine's time scale)."""

from __future__ import annotations

import statistics
from typing import Literal

import msgspec

Statistic = Literal["min", "median"]


class PrefillSample(msgspec.Struct, frozen=True, kw_only=True):
    """One prompt length, prefilled alone on an idle engine, ``len(seconds)`` times (one fresh prompt each)."""

    tokens: int  # prompt length, exact (the prompt is token ids)
    passes: int  # forward passes the engine takes for it: ceil(tokens / chunked_prefill_size), 1 unchunked
    seconds: list[float]  # time to the first (and only) token, one per repetition

    @property
    def median_s(self) -> float:
        return statistics.median(self.seconds)

    def value_s(self, statistic: Statistic) -> float:
        """The point the fit uses: the fastest repetition (``min``: noise only ever adds time) or the median."""
        return min(self.seconds) if statistic == "min" else self.median_s


class DecodeSample(msgspec.Struct, frozen=True, kw_only=True):
    """One segment of a decode experiment's steady window: every step ran ``batch`` sequences, nothing else."""

    batch: int  # sequences in every step of the segment
    prompt_tokens: int  # prompt length of each request of the experiment
    context_tokens: float  # context tokens of the whole batch at the segment's middle step
    step_s: float  # mean step time over the segment
    steps: int  # step intervals the mean is over
    context_source: str  # "num_used_tokens" (the engine's /v1/loads) or "estimate" (prompt + tokens seen)
