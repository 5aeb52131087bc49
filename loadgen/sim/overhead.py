"""The serving path's own delay before a disaggregated request's first token, calibrated on the live stack.

The latency model covers GPU work and the KV copy. The live path adds dispatch, two HTTP legs, the
bootstrap handshake between the engines and the first token's trip back through the gateway. Replaying the
first 120 s of Azure conversation (456 requests) through the live 2P2D stack and through the simulator
with ``first_token_delay=NO_DELAY`` (2026-11-22, this 2-core machine; ``python -m tests.bench.sim_fidelity
--calibrate`` repeats the measurement, and the same command without the flag checks the calibrated result on
that slice and four others), TTFT differed by a nearly constant amount that did not depend on prompt length: p10/p50/p90
of 6.0 / 10.7 / 17.7 ms (a rerun gave 6.0 / 11.3 / 17.1 ms), while TPOT matched to 0.05 ms. This module draws that delay per request from a log-normal with the measured
median and p90, seeded by the request, so runs stay deterministic.

The delay belongs to the host as much as to the code. A later quiet rerun of the calibration slice gave a
median of 11.7 ms and p90 of 17.6 ms, but with other CPU-heavy work on the same two cores the median measured
on Azure conversation 40-55 s went from ~15 ms to 16-24 ms, and the live P50 TTFT rose by up to 12% while
TPOT did not move. It also grows a little with the stack's own load: ~12 ms for requests with at most two
arrivals in the second before them, ~14 ms with nine or more.

:meth:`FirstTokenDelay.fit` builds the delay from such a measurement, which is how the e2e fidelity test
(``tests/e2e/test_sim_fidelity.py``) adapts to the machine it runs on. What the delay cannot express: where
in the path it is spent. Live, part of it comes before the prefill (the decode engine claims the bootstrap
room only between two of its steps), so requests arriving a few ms apart can share a prefill step; here all
of it comes after the prefill.
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from dataclasses import dataclass

from loadgen.metrics import percentile

_Z90 = 1.2815515655446004  # standard normal quantile at 0.9


@dataclass(frozen=True)
class FirstTokenDelay:
    median_s: float = 0.0107
    p90_s: float = 0.0177
    seed: int = 0

    def __post_init__(self) -> None:
        if self.median_s < 0 or (self.median_s > 0 and self.p90_s < self.median_s):
            raise ValueError("first-token delay needs 0 <= median <= p90")

    @classmethod
    def fit(cls, deltas_s: Sequence[float], seed: int = 0) -> FirstTokenDelay:
        """The delay with the median and p90 of measured live-minus-model TTFTs (seconds, one per request).

        Negative quantiles (a live path faster than the model) clamp to 0.
        """
        median = max(0.0, percentile(deltas_s, 50))
        return cls(median_s=median, p90_s=max(median, percentile(deltas_s, 90)), seed=seed)

    def __call__(self, request_index: int) -> float:
        if self.median_s == 0:
            return 0.0
        sigma = math.log(self.p90_s / self.median_s) / _Z90
        rng = random.Random(self.seed * 1_000_003 + request_index)
        return self.median_s * math.exp(sigma * rng.gauss(0.0, 1.0))


NO_DELAY = FirstTokenDelay(median_s=0.0, p90_s=0.0)
LIVE_STACK_DELAY = FirstTokenDelay()
