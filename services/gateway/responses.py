"""The non-streaming OpenAI response a request gets when the gateway read its answer as a stream.

A request that moved between engines (migration, rescue) was streamed from each of them; the client that
asked for one JSON body gets it assembled here from those events: the text, the finish reason, the usage,
and the log-probabilities when it asked for them (each engine's pieces joined in order).
"""

from __future__ import annotations

from typing import Any

from services.gateway.legs import Event


def _logprobs(events: list[Event], endpoint: str) -> dict[str, Any] | None:
    pieces = [c["logprobs"] for e in events if (c := _choice(e)) is not None and isinstance(c.get("logprobs"), dict)]
    if not pieces:
        return None
    if endpoint == "chat":
        return {"content": [entry for p in pieces for entry in p.get("content") or []]}
    merged: dict[str, list[Any]] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for p in pieces:
        for key in ("tokens", "token_logprobs", "top_logprobs"):
            merged[key].extend(p.get(key) or [])
    # Each engine counts offsets from its own first token; the client's count from the answer's start.
    offset = 0
    for token in merged["tokens"]:
        merged["text_offset"].append(offset)
        offset += len(token) if isinstance(token, str) else 0
    return merged


def _choice(event: Event) -> dict[str, Any] | None:
    choices = event.data.get("choices")
    return choices[0] if isinstance(choices, list) and choices and isinstance(choices[0], dict) else None


def whole_response(events: list[Event], *, endpoint: str, client_id: str, created: int, model: str,
                   usage: dict[str, Any]) -> dict[str, Any]:
    """The chat.completion or text_completion body of an answer read as ``events``; ``usage`` is used where no
    event carried one."""
    text = "".join(e.text for e in events)
    finish = next((e.finish_reason for e in reversed(events) if e.finish_reason), None)
    reported = next((e.data["usage"] for e in reversed(events) if isinstance(e.data.get("usage"), dict)), None)
    logprobs = _logprobs(events, endpoint)
    if endpoint == "chat":
        choice: dict[str, Any] = {"index": 0, "message": {"role": "assistant", "content": text},
                                  "logprobs": logprobs, "finish_reason": finish}
        obj = "chat.completion"
    else:
        choice = {"index": 0, "text": text, "logprobs": logprobs, "finish_reason": finish}
        obj = "text_completion"
    return {"id": client_id, "object": obj, "created": created, "model": model, "choices": [choice],
            "usage": reported if reported is not None else usage}
