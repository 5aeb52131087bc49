"""Incremental parser for OpenAI-style streaming responses (Server-Sent Events).

Owns the interpretation of ``data:`` lines from ``/v1/completions`` and
``/v1/chat/completions`` streams: which chunks carry content, when each arrived,
how many tokens the server says it produced, and in-stream error objects.
Kept separate from the HTTP client so it can be tested on plain strings.
"""

from __future__ import annotations

from typing import Any

import orjson


def _chunk_has_content(chunk: dict[str, Any]) -> bool:
    choices = chunk.get("choices")
    if not isinstance(choices, list):
        return False
    for choice in choices:
        if not isinstance(choice, dict):
            continue
        if choice.get("text"):
            return True
        delta = choice.get("delta")
        if isinstance(delta, dict) and (
            delta.get("content") or delta.get("reasoning_content") or delta.get("reasoning")
        ):
            return True
    return False


def error_message(payload: Any) -> str | None:
    """The human message of an OpenAI (``{"error": {"message"}}``) or similar error body."""
    if not isinstance(payload, dict):
        return None
    error = payload.get("error")
    if isinstance(error, dict) and error.get("message"):
        return str(error["message"])
    if isinstance(error, str) and error:
        return error
    for key in ("message", "detail"):
        if payload.get(key):
            return str(payload[key])
    return None


class StreamAccumulator:
    """Folds SSE lines of one response into token timing and counts.

    Call `feed_line` with each line and the time it arrived; it returns True at
    ``data: [DONE]``. A chunk counts as one content chunk when any choice has a
    non-empty ``text`` (completions) or ``delta.content`` (chat). The token count
    is the last ``usage.completion_tokens`` seen (servers send it in the final
    chunk with ``stream_options.include_usage``), else the number of content
    chunks.
    """

    def __init__(self, keep_token_times: bool = True) -> None:
        self.keep_token_times = keep_token_times
        self.first_token_s: float | None = None
        self.last_token_s: float | None = None
        self.content_chunks = 0
        self.usage_completion_tokens: int | None = None
        self.token_times_s: list[float] = []
        self.error: str | None = None
        self.done = False

    @property
    def tokens_received(self) -> int:
        if self.usage_completion_tokens is not None:
            return self.usage_completion_tokens
        return self.content_chunks

    def feed_line(self, line: str, now_s: float) -> bool:
        """Consume one line; return True once the stream's ``[DONE]`` marker is seen.

        Raises ValueError on a ``data:`` payload that is not JSON.
        """
        if not line.startswith("data:"):
            return self.done  # blank separators, comments (":"), "event:"/"id:" fields
        payload = line[5:].strip()
        if not payload:
            return self.done
        if payload == "[DONE]":
            self.done = True
            return True
        try:
            chunk = orjson.loads(payload)
        except orjson.JSONDecodeError as exc:
            raise ValueError(f"malformed stream chunk ({exc}): {payload[:200]!r}") from None
        if not isinstance(chunk, dict):
            return self.done
        if "error" in chunk or chunk.get("object") == "error":
            self.error = error_message(chunk) or payload[:500]
            return self.done
        if _chunk_has_content(chunk):
            self.content_chunks += 1
            if self.first_token_s is None:
                self.first_token_s = now_s
            self.last_token_s = now_s
            if self.keep_token_times:
                self.token_times_s.append(now_s)
        usage = chunk.get("usage")
        if isinstance(usage, dict) and isinstance(usage.get("completion_tokens"), int):
            self.usage_completion_tokens = usage["completion_tokens"]
        return self.done
