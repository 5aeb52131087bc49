"""Placeholder output tokens and the output-length model.

engine_sim has no model and no tokenizer. Output token ids are drawn from a ``random.Random`` seeded by
``(seed, key)``, where the key is a digest of the prompt (the rid for requests submitted without one). The id
at each position is therefore a pure function of the request and the position: a rerun gives the same ids,
a PD pair (the router sends the same body to both) gives the same sequence as a colocated engine, and a
request resumed on another engine after a migration continues the same sequence (``poise_resume``). The text of a token is
a placeholder word (``" tok1234"``): one word per token, so clients can count tokens in the text. Nothing
about the text is meaningful.

Output length: with ``ignore_eos`` the request runs to ``max_new_tokens`` ("length"). Without it, the
stop point is geometric with mean ``mean_output_tokens`` (one draw per request, seeded by ``(seed, key)``);
the last token is then the EOS id and the finish reason is "stop", as SGLang reports a matched EOS.
"""

from __future__ import annotations

import math
import random
from collections.abc import Iterator

VOCAB_TEXT_TOKENS = 128000  # Llama-3 ids below 128000 are text; 128000+ are special tokens
EOS_TOKEN_ID = 128009  # Llama-3 <|eot_id|>: what SGLang reports as finish_reason.matched for an EOS stop


def token_text(token_id: int) -> str:
    """The placeholder text of one token (special tokens such as EOS render as "", like skip_special_tokens)."""
    if token_id >= VOCAB_TEXT_TOKENS:
        return ""
    return f" tok{token_id}"


def detokenize(token_ids: list[int]) -> str:
    return "".join([token_text(t) for t in token_ids])


class TokenSource:
    """The deterministic id sequence of one request: ``next()`` returns the ids in order."""

    __slots__ = ("_rng",)

    def __init__(self, seed: int, key: str) -> None:
        self._rng = random.Random(f"{seed}:{key}")

    def next(self) -> int:
        return self._rng.randrange(VOCAB_TEXT_TOKENS)

    def peek(self) -> int:
        """The next id, without consuming it."""
        state = self._rng.getstate()
        token = self._rng.randrange(VOCAB_TEXT_TOKENS)
        self._rng.setstate(state)
        return token

    def clone(self) -> TokenSource:
        """An independent copy at the same position (to look ahead without consuming)."""
        copy = TokenSource.__new__(TokenSource)
        copy._rng = random.Random()
        copy._rng.setstate(self._rng.getstate())
        return copy

    def __iter__(self) -> Iterator[int]:
        """The ids from here on, without end."""
        return iter(self.next, -1)

    def skip(self, n: int) -> None:
        """Advance past ``n`` ids another engine already produced (the decode side skips the first token)."""
        for _ in range(n):
            self._rng.randrange(VOCAB_TEXT_TOKENS)


def draw_output_length(seed: int, key: str, mean_tokens: float) -> int:
    """Geometric output length (>= 1) with the given mean, deterministic per (seed, key)."""
    if mean_tokens <= 1.0:
        return 1
    p = 1.0 / mean_tokens
    u = random.Random(f"{seed}:{key}:length").random()
    # Inverse CDF of the geometric distribution on {1, 2, ...}: mean 1/p.
    return 1 + int(math.log1p(-u) / math.log1p(-p))
