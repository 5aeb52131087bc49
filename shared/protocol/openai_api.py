"""Defaults of the OpenAI API that SGLang follows and Poise's gateway and engine_sim both apply."""

from __future__ import annotations

#: ``max_tokens`` of a completions request that gives none (the OpenAI API's; SGLang's CompletionRequest).
COMPLETIONS_DEFAULT_MAX_TOKENS = 16
