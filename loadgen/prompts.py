"""Deterministic synthetic prompts of exact token length for trace replay.

Traces give lengths, not text, so the replay invents token ids. Owns how: ids
are a pure function of the request's ``index`` and ``hash_ids`` (no RNG state),
so every replay of a trace sends byte-identical prompts, and two requests that
share leading Mooncake ``hash_ids`` share identical leading 512-token blocks,
letting a server's prefix cache hit exactly where the trace says it could.
Also owns the approximate-length plain-text prompts used for chat endpoints.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence

from loadgen.workload import HASH_BLOCK_TOKENS

#: Default vocabulary the ids are drawn from (Llama-2 size; fits most models).
DEFAULT_VOCAB_SIZE = 32000
#: Ids below this are avoided: tokenizers usually put BOS/EOS/pad there.
LOWEST_TOKEN_ID = 100
#: Approximate characters per token for the chat text prompts.
CHARS_PER_TOKEN = 4


def _block_ids(seed: bytes, count: int, vocab_size: int) -> list[int]:
    """``count`` pseudo-random ids in ``[LOWEST_TOKEN_ID, vocab_size)`` from a seed.

    SHAKE-128 output is fixed by the standard, so ids never change across Python
    versions or platforms (unlike `random` seeding of arbitrary objects).
    """
    span = vocab_size - LOWEST_TOKEN_ID
    raw = hashlib.shake_128(seed).digest(2 * count)
    return [LOWEST_TOKEN_ID + value % span for value in struct.unpack(f"<{count}H", raw)]


def prompt_token_ids(
    index: int,
    input_tokens: int,
    hash_ids: Sequence[int] = (),
    vocab_size: int = DEFAULT_VOCAB_SIZE,
) -> list[int]:
    """Exactly ``input_tokens`` token ids for the request.

    Block ``i`` (512 tokens) comes from ``hash_ids[i]`` when present, so equal
    hash ids give equal blocks; positions not covered by ``hash_ids`` are unique
    to the request (seeded by ``index``), so requests without hash ids never
    share a prefix by accident.
    """
    if input_tokens < 0:
        raise ValueError(f"input_tokens must be >= 0, got {input_tokens}")
    if vocab_size <= LOWEST_TOKEN_ID:
        raise ValueError(f"vocab_size must be > {LOWEST_TOKEN_ID}, got {vocab_size}")
    ids: list[int] = []
    block = 0
    while len(ids) < input_tokens:
        count = min(HASH_BLOCK_TOKENS, input_tokens - len(ids))
        shared = block < len(hash_ids)
        seed = b"poise-block:%d" % hash_ids[block] if shared else b"poise-request:%d:%d" % (index, block)
        # A shared block cut short is a prefix of the full block, so prefixes still match.
        ids.extend(_block_ids(seed, HASH_BLOCK_TOKENS, vocab_size)[:count])
        block += 1
    return ids


def _word(token_id: int) -> str:
    """A 3-letter pseudo-word (plus a space: 4 chars, about one token)."""
    letters = "abcdefghijklmnopqrstuvwxyz"
    return letters[token_id % 26] + letters[token_id // 26 % 26] + letters[token_id // 676 % 26]


def prompt_text(index: int, input_tokens: int, hash_ids: Sequence[int] = ()) -> str:
    """Plain text of about ``input_tokens`` tokens, assuming ~4 characters per token.

    Only approximate (real tokenizers split pseudo-words unpredictably), which is
    fine for chat-endpoint demos; use the completions endpoint with token ids
    when lengths must be exact.
    """
    words = [_word(t) for t in prompt_token_ids(index, input_tokens, hash_ids)]
    return " ".join(words)
