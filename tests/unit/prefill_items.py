"""A bare prompt that satisfies shared.policies' PrefillItem, for the prefill policy tests."""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass
class Prompt:
    rid: str
    arrival_s: float
    input_tokens: int
    slo_ttft_s: float = math.inf
    prefilled: int = 0
