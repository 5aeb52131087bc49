"""The serving path's own delay before a disaggregated request's first token, calibrated on the live stack.

The latency model covers GPU work and the KV copy. The live path adds dispatch, two HTTP legs, the
bootstrap handshake between the engines and the first token's trip back through the gateway. Replaying the
first 120 s of Azure conversation (456 requests) through the live 2P2D stack and through the simulator
with ``first_token_delay=NO_DELAY`` (2026-11-22, this 2-core machine; ``python -m tests.bench.sim_fidelity
--calibrate`` repeats the measurement, and the same command without the flag checks the calibrated result on
that slice and four others), TTFT differed by a nearly constant amount that did not depend on prompt length: p10/p50/p90
of 6.0 / 10.7 / 17.7 ms (a rerun gave 6.0 / 11.3 / 17.1 ms), while TPOT matched to 0.05 ms. This module draws that delay per request from a log-normal with the measured
median and p90, seeded by the request, so runs stay deterministic.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

_Z90 = 1.2815515655446004  # standard normal quantile at 0.9


@dataclass(frozen=True)
class FirstTokenDelay:
    median_s: float = 0.0107
    p90_s: float = 0.0177
    seed: int = 0

    def __post_init__(self) -> None:
        if self.median_s < 0 or (self.median_s > 0 and self.p90_s < self.median_s):
            raise ValueError("first-token delay needs 0 <= median <= p90")

    def __call__(self, request_index: int) -> float:
        if self.median_s == 0:
            return 0.0
        sigma = math.log(self.p90_s / self.median_s) / _Z90
        rng = random.Random(self.seed * 1_000_003 + request_index)
        return self.median_s * math.exp(sigma * rng.gauss(0.0, 1.0))


NO_DELAY = FirstTokenDelay(median_s=0.0, p90_s=0.0)
LIVE_STACK_DELAY = FirstTokenDelay()
