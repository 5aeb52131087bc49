"""The engine body that continues a request from the tokens its client already has.

Used when the gateway moves a running request to another decode engine (migration) or rescues it from one
that died mid-answer. What the target needs depends on the engine (shared/protocol/request_resume.py):

- engine_sim: the client's body unchanged plus ``poise_resume`` (how many tokens were generated; for a KV
  copy, where the request runs now). engine_sim continues the same token sequence from that position.
- stock SGLang (recompute only): the prompt grows by the text already sent. Completions: ``prompt + text``
  (a prompt given as token ids cannot be extended from text: not resumable). Chat: the text becomes a final
  assistant message continued with SGLang's ``continue_final_message`` (ChatCompletionRequest, 0.5.23).
  The re-tokenised text may split differently from the original ids at the seam: a real model then
  continues from an equivalent, not byte-identical, context.

Either way ``max_tokens`` shrinks by what was generated, so the whole answer keeps the client's limit.
"""

from __future__ import annotations

from typing import Any

from services.gateway.validation import ParsedRequest
from shared.protocol import InstanceInfo
from shared.protocol.request_resume import RESUME_FIELD, RequestResume


class NotResumable(Exception):
    """The request cannot be continued on that engine (the caller keeps it where it is, or fails it)."""


def resume_body(parsed: ParsedRequest, target: InstanceInfo, *, generated_tokens: int, generated_text: str,
                kv_source: tuple[str, str] | None = None) -> dict[str, Any]:
    """The body for ``target`` continuing after ``generated_tokens`` tokens (``generated_text``)."""
    remaining = parsed.max_tokens - generated_tokens
    if parsed.limited and remaining < 1:
        raise NotResumable("the request has no tokens left to generate")
    body = dict(parsed.body)
    if parsed.limited:  # an unlimited answer runs on to its end on the target too
        body["max_tokens"] = remaining
    if target.engine_kind == "sim":
        body[RESUME_FIELD] = RequestResume(
            generated_tokens=generated_tokens, kv_source_url=kv_source[0] if kv_source else None,
            kv_source_rid=kv_source[1] if kv_source else None).to_body()
        return body
    if kv_source is not None:
        raise NotResumable(f"{target.engine_kind} engines cannot take a KV copy from another decode engine")
    if parsed.endpoint == "chat":
        messages = list(body["messages"])
        last = messages[-1] if messages else None
        if body.get("continue_final_message") and isinstance(last, dict) and last.get("role") == "assistant" \
                and isinstance(last.get("content"), str):
            messages[-1] = {**last, "content": last["content"] + generated_text}
        else:
            messages.append({"role": "assistant", "content": generated_text})
        body["messages"] = messages
        body["continue_final_message"] = True
        return body
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    if not isinstance(prompt, str):
        raise NotResumable("a prompt of token ids cannot be extended with the generated text on SGLang")
    body["prompt"] = prompt + generated_text
    return body
