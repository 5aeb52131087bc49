"""Log-probabilities of engine_sim's placeholder tokens, in the OpenAI shapes SGLang answers with.

engine_sim has no model, so the numbers mean nothing; what is real is the contract: a request that asks for
``logprobs`` gets one entry per output token, with the ``top_logprobs`` it asked for, in the shape the
endpoint documents (chat: ``{"content": [{"token", "bytes", "logprob", "top_logprobs"}]}``; completions:
``{"tokens", "token_logprobs", "top_logprobs", "text_offset"}``, sglang/srt/entrypoints/openai/protocol.py).
Each value is a pure function of the token id, so the same answer always has the same log-probabilities.
The sampled token is the most likely one (greedy decoding), and its alternatives follow it in order.
"""

from __future__ import annotations

from typing import Any

from services.engine_sim.tokens import VOCAB_TEXT_TOKENS, token_text

_ALTERNATIVE_STRIDE = 7919  # a prime: the alternatives of one token are distinct ids


def token_logprob(token_id: int) -> float:
    """The sampled token's log-probability, in (-2, 0]."""
    return -((token_id * 2654435761) % 1000) / 500.0


def top_tokens(token_id: int, k: int) -> list[tuple[int, float]]:
    """The ``k`` most likely tokens at this position, most likely first: the sampled one, then others."""
    lp = token_logprob(token_id)
    return [((token_id + j * _ALTERNATIVE_STRIDE) % VOCAB_TEXT_TOKENS if j else token_id, lp - 0.75 * j)
            for j in range(k)]


def _entry(token_id: int, logprob: float) -> dict[str, Any]:
    text = token_text(token_id)
    return {"token": text, "bytes": list(text.encode()), "logprob": logprob}


def chat_logprobs(ids: list[int], top: int) -> dict[str, Any]:
    """ChoiceLogprobs for ``ids`` with ``top`` alternatives a token (chat's ``top_logprobs``)."""
    return {"content": [{**_entry(t, token_logprob(t)), "top_logprobs": [_entry(a, lp) for a, lp in top_tokens(t, top)]}
                        for t in ids]}


def completion_logprobs(ids: list[int], top: int, text_offset: int = 0) -> dict[str, Any]:
    """LogProbs for ``ids`` with ``top`` alternatives a token (completions' ``logprobs``); ``text_offset`` is
    where the first token's text starts in the whole answer."""
    tokens, offsets = [], []
    for t in ids:
        offsets.append(text_offset)
        text = token_text(t)
        tokens.append(text)
        text_offset += len(text)
    return {"tokens": tokens, "token_logprobs": [token_logprob(t) for t in ids],
            "top_logprobs": [{token_text(a): lp for a, lp in top_tokens(t, top)} for t in ids],
            "text_offset": offsets}
