"""The serving path's own delay before a disaggregated request's first token, calibrated on the live stack.

The latency model covers GPU work and the KV copy. The live path adds dispatch, two HTTP legs, the
bootstrap handshake between the engines and the first token's trip back through the gateway. Part of it
comes *before* the prefill: the decode engine claims the bootstrap room only between two of its steps
(the simulator models that wait) and the claim takes an HTTP hop to the prefill engine (``handshake_s``,
4 ms, ours); so requests arriving a few ms apart can share a prefill step, as they do live. The rest comes
after the prefill and is drawn per request from a log-normal with a measured median and p90, seeded by the
request so runs stay deterministic.

Calibration: replay the first 120 s of Azure conversation (456 requests) through the live 2P2D stack and
through the simulator with ``HANDSHAKE_ONLY`` and take live minus simulated TTFT per request
(``python -m tests.bench.sim_fidelity --calibrate``; the same command without the flag checks the result on
that slice and four held-out ones). On 2026-11-22 on this 2-core machine with nothing else running (load
average 0.5-0.9), that gave a median of 4.4 ms and a p90 of 10.2 ms; TPOT matched to 0.05 ms. With other work
on the cores (load ~2.5) the same measurement gave 7.4 / 19.4 ms. Before the handshake was modelled, the
whole delay sat after the prefill: 10.7 / 17.7 ms.

The delay belongs to the host as much as to the code. With other CPU-heavy work on the same two cores the
median measured on Azure conversation 40-55 s went from ~15 ms to 16-24 ms, and the live P50 TTFT rose by up
to 12% while TPOT did not move. It also grows a little with the stack's own load: ~12 ms for requests with at
most two arrivals in the second before them, ~14 ms with nine or more.

:meth:`FirstTokenDelay.fit` builds the delay from such a measurement, which is how the e2e fidelity test
(``tests/e2e/test_sim_fidelity.py``) adapts to the machine it runs on.
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
    median_s: float = 0.0044
    p90_s: float = 0.0102
    seed: int = 0
    # The part of the path before the prefill: the decode engine's claim of the bootstrap room reaching the
    # prefill engine (one HTTP hop; the claim itself waits for the decode engine's step boundary, which the
    # simulator models). 0 = all of the delay after the prefill.
    handshake_s: float = 0.0

    def __post_init__(self) -> None:
        if self.median_s < 0 or (self.median_s > 0 and self.p90_s < self.median_s):
            raise ValueError("first-token delay needs 0 <= median <= p90")

    @classmethod
    def fit(cls, deltas_s: Sequence[float], seed: int = 0, handshake_s: float = 0.0) -> FirstTokenDelay:
        """The delay with the median and p90 of measured live-minus-model TTFTs (seconds, one per request).

        The deltas must be measured against a simulator with the same ``handshake_s`` (``HANDSHAKE_ONLY``
        for the default): the fitted delay is what remains after the prefill. Negative quantiles (a live path
        faster than the model) clamp to 0.
        """
        median = max(0.0, percentile(deltas_s, 50))
        return cls(median_s=median, p90_s=max(median, percentile(deltas_s, 90)), seed=seed, handshake_s=handshake_s)

    def __call__(self, request_index: int) -> float:
        if self.median_s == 0:
            return 0.0
        sigma = math.log(self.p90_s / self.median_s) / _Z90
        rng = random.Random(self.seed * 1_000_003 + request_index)
        return self.median_s * math.exp(sigma * rng.gauss(0.0, 1.0))


#: One HTTP hop on loopback between the decode engine's room claim and the prefill engine (ours, ~4 ms
#: as measured around the handshake in the fidelity investigation; the wait for the decode engine's step
#: boundary comes on top and is simulated).
HANDSHAKE_S = 0.004
NO_DELAY = FirstTokenDelay(median_s=0.0, p90_s=0.0)
HANDSHAKE_ONLY = FirstTokenDelay(median_s=0.0, p90_s=0.0, handshake_s=HANDSHAKE_S)  # what calibration fits against
LIVE_STACK_DELAY = FirstTokenDelay(handshake_s=HANDSHAKE_S)
