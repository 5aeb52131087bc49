"""Which running decode request gives its KV back first when a step's growth does not fit.

SGLang 0.5.23's order (``ScheduleBatch._get_decode_retraction_order``, without its priority option): the
request with the fewest output tokens goes first, among those the longest prompt. engine_sim and the
simulator's ``grow`` KV model both retract by it.
"""

from __future__ import annotations


def retraction_key(output_tokens: int, prompt_tokens: int) -> tuple[int, int]:
    """Sort key: the running request with the smallest key is retracted first."""
    return output_tokens, -prompt_tokens
