"""When the simulated engines run their length predictor: every k decode steps, counting down in between.

ARES re-runs its predictor every k = 20 decode iterations (§5.3: 0.38% overhead) and the estimate is
decremented by the tokens generated since (spec §1.2.6 [REC]): ``N_hat(now) = max(1, N_hat(g_p) - (g - g_p))``
with ``g_p`` the last multiple of k at or below the request's generated tokens ``g`` (0: the prediction at
the end of prefill). The simulator asks only when it builds a snapshot, and computes the prediction of the
latest cadence point then: the same numbers as predicting eagerly at every k-th step, at a fraction of the
cost. The simulator knows each request's true output length and hands it to the predictor (``oracle`` and
``ares-noise`` need it; the others ignore it).
"""

from __future__ import annotations

from loadgen.sim.instance import SimRequest
from shared.policies import LengthPredictor, RequestView
from shared.policies.length import counted_down

DEFAULT_INTERVAL_TOKENS = 20  # ARES k


class PredictionCadence:
    def __init__(self, predictor: LengthPredictor, interval_tokens: int = DEFAULT_INTERVAL_TOKENS) -> None:
        if interval_tokens < 1:
            raise ValueError(f"the prediction interval must be at least 1 token, got {interval_tokens}")
        self.predictor = predictor
        self.interval = interval_tokens

    def remaining(self, req: SimRequest) -> float:
        g = req.generated
        at = g - g % self.interval
        if req.predicted_at != at:  # a new cadence point since the last snapshot: predict there
            view = RequestView(rid=req.rid, input_tokens=req.input_tokens, max_output_tokens=req.output_tokens)
            req.predicted = self.predictor.predict_remaining(view, at, req.output_tokens)
            req.predicted_at = at
        return counted_down(req.predicted, at, g)
