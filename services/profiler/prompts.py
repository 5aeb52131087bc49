"""Prompts and request bodies: token ids, so lengths are exact, and fresh ones, so no prefix cache helps.

SGLang's radix cache would skip the prefill of a prompt it has seen (or of a shared prefix), so every request
gets its own random ids. Ids stay in [1000, 30000): ordinary tokens in every common vocabulary (Llama 3's is
128K, Mistral's 32K), away from the special tokens at either end.
"""

from __future__ import annotations

import random
from typing import Any

import orjson

ID_LOW, ID_HIGH = 1000, 30000


def token_prompt(rng: random.Random, tokens: int) -> list[int]:
    return [rng.randrange(ID_LOW, ID_HIGH) for _ in range(tokens)]


def generate_body(input_ids: list[int], max_new_tokens: int, *, rid: str, stream: bool = False) -> bytes:
    """A ``/generate`` body (SGLang's GenerateReqInput): exactly ``max_new_tokens`` tokens, greedy."""
    body: dict[str, Any] = {
        "input_ids": input_ids,
        "sampling_params": {"max_new_tokens": max_new_tokens, "ignore_eos": True, "temperature": 0.0},
        "rid": rid,
        "stream": stream,
    }
    return orjson.dumps(body)
