"""Resuming a request mid-answer on another engine (a Poise extension of SGLang's request body).

The gateway resumes a request when it migrates it to another decode instance (ARES' decode-to-decode
rescheduling) or rescues it from a decode engine that died mid-answer. Two mechanisms:

- ``recompute`` (any engine): a new prefill of the prompt plus the tokens already generated, handed to the
  target decode engine through a prefill engine with a new bootstrap room. Stock SGLang has no resume field,
  so the gateway extends the prompt itself (completions: prompt + generated text; chat: the generated text as
  a final assistant message with SGLang's ``continue_final_message``). engine_sim has no tokenizer: it gets
  the original prompt and ``poise_resume`` saying how many tokens were generated, prefills prompt + those
  tokens, and continues the request's token sequence from that position.
- ``kv-transfer`` (engine_sim only, modelling ARES' asynchronous D→D KV copy): the target decode engine is
  told where the request runs now (``kv_source_url`` / ``kv_source_rid``); it checks with the source that the
  request is there, reserves KV, waits the copy time at its configured migration bandwidth, and continues.

engine_sim's tokens are a pure function of the request's content and the position, so a resumed request
continues exactly where the client's stream left off, whichever engine produces it.
"""

from __future__ import annotations

from typing import Any

import msgspec

#: Body field carrying :class:`RequestResume` on engine requests (engine_sim only).
RESUME_FIELD = "poise_resume"


class RequestResume(msgspec.Struct, frozen=True, kw_only=True):
    schema: str = "poise.v1.request_resume"
    generated_tokens: int  # tokens the client already has: the engine continues at this position
    kv_source_url: str | None = None  # kv-transfer: the decode engine the request runs on now
    kv_source_rid: str | None = None  # ...and its rid there

    def __post_init__(self) -> None:
        if self.generated_tokens < 0:
            raise ValueError(f"generated_tokens must be >= 0, got {self.generated_tokens}")
        if (self.kv_source_url is None) != (self.kv_source_rid is None):
            raise ValueError("kv_source_url and kv_source_rid go together")

    @property
    def kv_transfer(self) -> bool:
        return self.kv_source_url is not None

    def to_body(self) -> dict[str, Any]:
        return msgspec.to_builtins(self)  # type: ignore[no-any-return]


def parse_request_resume(value: Any) -> RequestResume:
    """The ``poise_resume`` field of an engine request body; ValueError with a readable message when malformed."""
    if not isinstance(value, dict):
        raise ValueError(f"{RESUME_FIELD} must be an object")
    try:
        return msgspec.convert(value, RequestResume)
    except msgspec.ValidationError as exc:
        raise ValueError(f"{RESUME_FIELD}: {exc}") from None
