"""The planner's ISL forecast, handed to an engine's prefill policy (a Poise extension of engine_sim's API).

``POST /poise_sim/forecast`` with ``{"isl": <tokens> | null}`` sets (or, with null, withdraws) the forecast
mean input length that DOPD's length-aware prefill batching (``dopd-length``) uses as its long-prompt
threshold and packing cap; ``GET`` (and the ``POST``'s reply) returns ``{"isl", "policy", "applies",
"long_threshold"}``, the last being the threshold in force (the forecast, else the policy's running mean).
Policies without a use for it accept and ignore it (``applies: false``). The worker sidecar relays the
planner's ``forecast`` events (services/worker/forecast.py); stock SGLang has no such hook and gets none.
"""

from __future__ import annotations

FORECAST_PATH = "/poise_sim/forecast"
