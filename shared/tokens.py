"""Counting prompt tokens at the gateway, where no engine has tokenized the request yet.

With a tokenizer configured (a local Hugging Face tokenizer directory or name available offline) the count
is exact. Without one, text is estimated at 4 characters per token, the usual rule of thumb for English
BPE vocabularies (OpenAI's tokenizer guide), plus a few tokens per chat message for the template. The count
only steers load balancing; engines still tokenize for real. Token-id prompts are counted exactly.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, Protocol

CHARS_PER_TOKEN = 4.0
CHAT_TOKENS_PER_MESSAGE = 4  # role markers and separators of a typical chat template
CHAT_TOKENS_PER_REPLY = 3  # the assistant header the template appends


class TokenCounter(Protocol):
    def count_text(self, text: str) -> int: ...


class EstimatingCounter:
    """``ceil(len(text) / 4)``: documented estimate used when no tokenizer is configured."""

    name = "estimate(4 chars/token)"

    def count_text(self, text: str) -> int:
        return math.ceil(len(text) / CHARS_PER_TOKEN) if text else 0


class HFTokenizerCounter:
    """Exact counts from a Hugging Face tokenizer (transformers is imported only when configured)."""

    def __init__(self, name_or_path: str) -> None:
        try:
            from transformers import AutoTokenizer
        except ImportError as exc:  # optional dependency
            raise RuntimeError("tokenizer configured but transformers is not installed: pip install transformers") from exc
        self._tok = AutoTokenizer.from_pretrained(name_or_path, local_files_only=True)
        self.name = f"tokenizer({name_or_path})"

    def count_text(self, text: str) -> int:
        return len(self._tok.encode(text, add_special_tokens=False))


def make_counter(tokenizer: str | None) -> TokenCounter:
    return HFTokenizerCounter(tokenizer) if tokenizer else EstimatingCounter()


def count_prompt(counter: TokenCounter, prompt: str | Sequence[int]) -> int:
    if isinstance(prompt, str):
        return counter.count_text(prompt)
    return len(prompt)


def count_chat(counter: TokenCounter, messages: Sequence[dict[str, Any]]) -> int:
    total = CHAT_TOKENS_PER_REPLY
    for message in messages:
        total += CHAT_TOKENS_PER_MESSAGE + counter.count_text(message_text(message))
    return total


def message_text(message: dict[str, Any]) -> str:
    content = message.get("content")
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(p.get("text", "") for p in content if isinstance(p, dict))
    return ""
