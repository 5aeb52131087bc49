"""Remaining-length predictions on the decode stream (a Poise extension; ARES' continuous re-prediction).

ARES predicts each running request's remaining output length from the decode engine's hidden state every
k decode steps (spec §1.2.6). The prediction has to reach the migrator, which sees requests through the
gateways; the gateway already reads every decode stream, so the engine puts the prediction on the stream:

- the gateway asks for it with ``"poise_predict_length": true`` in the decode body (engine_sim only: stock
  SGLang has no predictor hook; see services/predictor/README.md for what one needs);
- the engine adds ``"poise_predicted_remaining": <tokens>`` to the chunk at every k-th generated token;
- the gateway strips the field before the client sees the chunk, and offers the latest prediction, less the
  tokens generated since, in its table of movable requests (``DecodeRequestInfo.predicted_remaining_tokens``).
"""

from __future__ import annotations

#: Decode-body flag: put remaining-length predictions on the stream.
PREDICT_FIELD = "poise_predict_length"
#: Chunk field carrying one prediction (float, tokens still to generate after this chunk).
PREDICTION_FIELD = "poise_predicted_remaining"
#: ARES re-predicts every k decode steps; k = 20 keeps the overhead near 0.4% (spec §1.2.6).
DEFAULT_PREDICT_EVERY_TOKENS = 20
