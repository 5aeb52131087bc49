"""Local prefill on a decode engine (DOPD's "PD aggregation"; a Poise extension of engine_sim's API).

DOPD prefills ultra-short prompts on the decode instance itself, merged with its decode steps: for those the
KV transfer costs more than the prefill (spec-arrow-dopd.md B4, errata 9). The dispatcher decides
(shared/policies/local_prefill.py); the gateway then sends the request to the decode engine alone, with no
bootstrap fields and ``"poise_local_prefill": true`` in the body, and engine_sim's decode mode prefills it in
its own steps. Stock SGLang's PD decode engines cannot prefill, so no request goes there this way.
"""

from __future__ import annotations

#: Body flag: this decode engine prefills the prompt itself (no prefill peer, no bootstrap room).
LOCAL_PREFILL_FIELD = "poise_local_prefill"
