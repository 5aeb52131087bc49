"""A prompt's prefix identity: chained hashes of its blocks, as a radix cache would see shared prefixes.

Block ``i``'s id hashes block ``i``'s content together with block ``i - 1``'s id, so two prompts have equal
ids up to the first block where they differ, and never after it (a later block equal by chance does not
match). Token-id prompts hash 512-token blocks (the Mooncake traces' ``hash_ids`` granularity; the load
generator builds its prompts so that equal ``hash_ids`` give equal token blocks, ``loadgen/prompts.py``);
text prompts, where no tokenizer has run yet, hash blocks of 2048 characters (about 512 tokens at the
gateway's 4 characters per token), as SMG's router matches raw text. The ids are the same in every
process (BLAKE2b, not Python's salted ``hash``), so the gateway and the engines agree on them.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence
from typing import Any

from shared.engine.prefix_cache import BLOCK_TOKENS
from shared.tokens import message_text

BLOCK_CHARS = 4 * BLOCK_TOKENS


def _chain(parts: Sequence[bytes]) -> tuple[int, ...]:
    out: list[int] = []
    prev = b""
    for part in parts:
        prev = hashlib.blake2b(prev + part, digest_size=8).digest()
        out.append(int.from_bytes(prev, "little") >> 1)  # 63 bits: a non-negative int anywhere
    return tuple(out)


def token_blocks(token_ids: Sequence[int], block_tokens: int = BLOCK_TOKENS) -> tuple[int, ...]:
    """The prefix block ids of a token-id prompt (the last block may be shorter)."""
    n = len(token_ids)
    return _chain([struct.pack(f"<{min(block_tokens, n - i)}q", *token_ids[i:i + block_tokens])
                   for i in range(0, n, block_tokens)])


def text_blocks(text: str, block_chars: int = BLOCK_CHARS) -> tuple[int, ...]:
    """The prefix block ids of a text prompt (blocks of ``block_chars`` characters)."""
    return _chain([text[i:i + block_chars].encode() for i in range(0, len(text), block_chars)])


def prompt_blocks(prompt: str | Sequence[int] | Sequence[dict[str, Any]]) -> tuple[int, ...]:
    """The prefix blocks of a request's prompt as the API carries it: token ids, text, or chat messages
    (rendered one per line as ``role: content``, so a conversation's next turn extends its last)."""
    if isinstance(prompt, str):
        return text_blocks(prompt)
    if prompt and isinstance(prompt[0], dict):
        messages: Sequence[dict[str, Any]] = prompt  # type: ignore[assignment]
        return text_blocks("\n".join(f"{m.get('role')}: {message_text(m)}" for m in messages))
    return token_blocks(prompt)  # type: ignore[arg-type]
