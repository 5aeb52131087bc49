"""Arrow's per-instance TTFT predictor: prefill time = a*L^2 + b*L + c, profiled at start, refitted online.

Profiled from the engines' latency profile on a doubling grid of prompt lengths (Arrow profiles the real
engine at launch; on engine_sim the profile *is* the engine), then refitted from observed (prompt length,
prefill seconds) pairs by exponentially weighted least squares, so an instance that runs slower than its
profile (a hot GPU, co-running decode) is predicted slower. Pure: no I/O.
"""

from __future__ import annotations

import numpy as np

from shared.latency import LatencyModel


class QuadraticTtft:
    def __init__(self, a: float, b: float, c: float, *, decay: float = 0.98, prior_weight: float = 20.0) -> None:
        self.a, self.b, self.c = a, b, c
        self.decay = decay  # weight kept by past observations per new one (EW least squares)
        # Normal equations of the weighted fit, seeded with the profile as ``prior_weight`` pseudo-observations
        # spread over the profiled grid, so a few noisy observations cannot throw the fit far off.
        self._xtx = np.zeros((3, 3))
        self._xty = np.zeros(3)
        for length in _grid(32_768):
            self._add(length, self.predict(length), prior_weight / len(_grid(32_768)))
        self.observations = 0

    @classmethod
    def from_model(cls, model: LatencyModel, max_len: int = 32_768) -> QuadraticTtft:
        """Least-squares fit over 128, 256, ... ``max_len`` tokens (Arrow's launch-time profiling)."""
        lengths = _grid(max_len)
        x = np.array([[length * length, length, 1.0] for length in lengths])
        y = np.array([model.prefill_time_s(length) for length in lengths])
        a, b, c = np.linalg.lstsq(x, y, rcond=None)[0]
        return cls(float(a), float(b), float(c))

    def predict(self, length: float) -> float:
        return self.a * length * length + self.b * length + self.c

    def predict_uncached(self, length: float, cached: float, cached_sq: float) -> float:
        """A mean prompt of ``length`` tokens whose first ``cached`` (mean; ``cached_sq`` the mean of C^2, which
        E[C]^2 understates) a prefix cache holds: the quadratic's work past the prefix
        (``a (L^2 - C^2) + b (L - C)``) plus the per-prompt constant. No cache: exactly :meth:`predict`."""
        return self.a * (length * length - cached_sq) + self.b * (length - cached) + self.c

    def queue_delay(self, n: int, tokens: int, tokens_sq: int) -> float:
        """Predicted time to prefill ``n`` queued prompts of ``tokens`` total and ``tokens_sq`` squared total.

        The model is quadratic, so the sum over prompts needs only these three sums (no per-prompt list).
        """
        if n <= 0:
            return 0.0
        return self.a * tokens_sq + self.b * tokens + self.c * n

    def observe(self, length: int, seconds: float) -> None:
        """One prompt of ``length`` tokens took ``seconds`` to prefill alone: refit the coefficients."""
        if length <= 0 or not seconds > 0:
            return
        self._xtx *= self.decay
        self._xty *= self.decay
        self._add(length, seconds, 1.0)
        self.observations += 1
        try:
            a, b, c = np.linalg.solve(self._xtx, self._xty)
        except np.linalg.LinAlgError:
            return
        self.a, self.b, self.c = float(a), float(b), float(c)

    def _add(self, length: float, seconds: float, weight: float) -> None:
        x = np.array([length * length, length, 1.0])
        self._xtx += weight * np.outer(x, x)
        self._xty += weight * seconds * x


def _grid(max_len: int) -> list[int]:
    lengths, length = [], 128
    while length <= max_len:
        lengths.append(length)
        length *= 2
    return lengths
