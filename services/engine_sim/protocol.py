"""Request parsing and response shapes of SGLang's HTTP API, for the endpoints engine_sim serves.

Parsing is hand-written (not pydantic models) to keep the per-request cost low; it checks the fields
engine_sim uses and ignores the rest, as SGLang's pydantic models ignore unknown fields. Shapes come from:

- /generate: GenerateReqInput (sglang/srt/managers/io_struct.py) in, the tokenizer manager's output dict
  out (sglang/srt/managers/tokenizer_manager.py: ``{"text", "output_ids", "meta_info"}``);
- /v1/completions and /v1/chat/completions: CompletionRequest / ChatCompletionRequest and their responses
  and stream chunks (sglang/srt/entrypoints/openai/protocol.py, serving_completions.py, serving_chat.py,
  sse_utils.py, usage_processor.py);
- ``poise_slo`` (a Poise extension, shared/protocol/request_slo.py): the request's SLO targets, on all three;
- ``poise_resume`` (a Poise extension, shared/protocol/request_resume.py): continue a request another engine
  started (migration, rescue), on all three;
- errors: ErrorResponse (openai/protocol.py); the "Bad Request" type for malformed bodies is what SGLang's
  RequestValidationError handler sends (entrypoints/http_server.py), "BadRequestError" what
  OpenAIServingBase.create_error_response sends for a request it refuses.

Prompt lengths: engine_sim has no tokenizer. Token-id prompts count exactly; text is estimated at
ceil(chars / 4) and chat messages add a few template tokens each (shared/tokens.py, the same estimate the
gateway uses, so both sides agree on a request's size).
"""

from __future__ import annotations

import hashlib
import json
import time
from dataclasses import dataclass
from http import HTTPStatus
from typing import Any, Literal

import orjson

from services.engine_sim import clock
from services.engine_sim.logprobs import chat_logprobs, completion_logprobs
from services.engine_sim.requests import SimRequest
from shared.engine import prompt_blocks
from shared.protocol.length_prediction import PREDICT_FIELD, PREDICTION_FIELD
from shared.protocol.local_prefill import LOCAL_PREFILL_FIELD
from shared.protocol.openai_api import COMPLETIONS_DEFAULT_MAX_TOKENS
from shared.protocol.request_resume import RESUME_FIELD, RequestResume, parse_request_resume
from shared.protocol.request_slo import SLO_FIELD, RequestSlo, parse_request_slo
from shared.tokens import EstimatingCounter, count_chat, count_prompt

Kind = Literal["generate", "completion", "chat"]
_COUNTER = EstimatingCounter()
DEFAULT_GENERATE_MAX_NEW_TOKENS = 128  # SamplingParams.max_new_tokens default
WEIGHT_VERSION = "default"


class SchemaError(ValueError):
    """The body does not match the request model (SGLang: RequestValidationError -> 400 "Bad Request")."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class RequestRefused(ValueError):
    """A well-formed request engine_sim will not run (SGLang: ValueError / _validate_request -> 400)."""


@dataclass(slots=True)
class GenRequest:
    kind: Kind
    model: str
    prompt_tokens: int
    max_new_tokens: int | None
    stream: bool = False
    include_usage: bool = False
    continuous_usage: bool = False  # stream_options.continuous_usage_stats: usage on every content chunk
    ignore_eos: bool = False
    rid: str | None = None
    priority: int | None = None
    bootstrap_host: str | None = None
    bootstrap_port: int | None = None
    bootstrap_room: int | None = None
    slo: RequestSlo | None = None  # the poise_slo extension field (None: no targets)
    resume: RequestResume | None = None  # the poise_resume extension field (None: a new request)
    # What the output tokens and length are drawn from: the prompt's content, so the same prompt gets the same
    # answer on any engine (a migrated request continues its own sequence). None: the rid (direct submits).
    stream_key: str | None = None
    predict_length: bool = False  # poise_predict_length: remaining-length predictions on the stream
    local_prefill: bool = False  # poise_local_prefill: a decode engine prefills this prompt itself
    prefix_blocks: tuple[int, ...] = ()  # the prompt's prefix identity, what the radix cache matches on
    seed: int | None = None  # the request's sampling seed: the same answer on any engine
    stops: tuple[str, ...] = ()  # stop strings: the answer ends before the first one
    logprobs: int | None = None  # alternatives a token in the answer's log-probabilities; None: not asked for


def content_key(content: Any) -> str:
    """A short digest of a request's prompt (text, token ids or chat messages)."""
    return hashlib.blake2b(orjson.dumps(content), digest_size=8).hexdigest()


# -- field helpers ---------------------------------------------------------------------------------------
def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _int(body: dict[str, Any], name: str, default: int | None = None) -> int | None:
    v = body.get(name)
    if v is None:
        return default
    if isinstance(v, float) and v.is_integer():
        return int(v)
    if not _is_int(v):
        raise SchemaError(f"{name}: Input should be a valid integer, got {v!r}", name)
    return v


def _bool(body: dict[str, Any], name: str, default: bool = False) -> bool:
    v = body.get(name)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise SchemaError(f"{name}: Input should be a valid boolean, got {v!r}", name)
    return v


def _str(body: dict[str, Any], name: str) -> str | None:
    v = body.get(name)
    if v is None:
        return None
    if not isinstance(v, str):
        raise SchemaError(f"{name}: Input should be a valid string, got {v!r}", name)
    return v


def _number(body: dict[str, Any], name: str) -> None:
    v = body.get(name)
    if v is not None and (isinstance(v, bool) or not isinstance(v, int | float)):
        raise SchemaError(f"{name}: Input should be a valid number, got {v!r}", name)


def _scalar(body: dict[str, Any], name: str) -> None:
    """PD routing fields and rid may be lists in SGLang (batched requests); engine_sim serves one at a time."""
    if isinstance(body.get(name), list):
        raise RequestRefused(f"engine_sim does not support batched requests ({name} is a list)")


def _stop(body: dict[str, Any]) -> tuple[str, ...]:
    v = body.get("stop")
    if v is None:
        return ()
    if not isinstance(v, str) and not (isinstance(v, list) and all(isinstance(s, str) for s in v)):
        raise SchemaError(f"stop: Input should be a valid string or list of strings, got {v!r}", "stop")
    return tuple(s for s in ([v] if isinstance(v, str) else v) if s)


def _logprobs(body: dict[str, Any], kind: Kind) -> int | None:
    """How many alternatives a token the answer's log-probabilities carry; None: none asked for."""
    if kind == "chat":
        top = _int(body, "top_logprobs", 0) or 0
        return top if _bool(body, "logprobs") else None  # SGLang: top_logprobs alone asks for nothing
    if kind == "completion":
        return _int(body, "logprobs")
    if body.get("return_logprob"):
        raise RequestRefused("engine_sim does not return log-probabilities on /generate (return_logprob)")
    return None


def _unconstrained(body: dict[str, Any]) -> None:
    """engine_sim's text is placeholder words: it refuses, naming the field, what would constrain it, rather
    than accept and ignore it. A real SGLang engine runs these (its grammar backend, tool-call parsers)."""
    fmt = body.get("response_format")
    kind = fmt.get("type") if isinstance(fmt, dict) else fmt
    if fmt is not None and kind != "text":
        raise RequestRefused(f"engine_sim cannot constrain its placeholder text: response_format of type {kind!r} "
                             "needs a real engine (SGLang's grammar backend)")
    choice = body.get("tool_choice")
    if body.get("tools") and (choice == "required" or isinstance(choice, dict)):
        raise RequestRefused("engine_sim never calls a tool: a forced tool_choice needs a real engine "
                             "(SGLang with --tool-call-parser)")


def _slo(body: dict[str, Any]) -> RequestSlo | None:
    """The ``poise_slo`` extension (shared/protocol/request_slo.py): the request's latency targets and how long
    it had been in the system when the gateway sent it. Malformed: a schema error (400 "Bad Request")."""
    v = body.get(SLO_FIELD)
    if v is None:
        return None
    try:
        return parse_request_slo(v)
    except ValueError as exc:
        raise SchemaError(str(exc), SLO_FIELD) from None


def _resume(body: dict[str, Any]) -> RequestResume | None:
    v = body.get(RESUME_FIELD)
    if v is None:
        return None
    try:
        return parse_request_resume(v)
    except ValueError as exc:
        raise SchemaError(str(exc), RESUME_FIELD) from None


def _common(body: dict[str, Any], kind: Kind, model: str, prompt_tokens: int, max_new: int | None,
            content: Any) -> GenRequest:
    for name in ("rid", "bootstrap_host", "bootstrap_port", "bootstrap_room"):
        _scalar(body, name)
    for name in ("temperature", "top_p"):
        _number(body, name)
    stops = _stop(body)
    seed = _int(body, "seed")
    logprobs = _logprobs(body, kind)
    _unconstrained(body)
    _str(body, "user")
    hidden = body.get("return_hidden_states")
    if hidden is not None and not isinstance(hidden, bool) and hidden != "last":
        raise SchemaError("return_hidden_states: Input should be a valid boolean or 'last'", "return_hidden_states")
    n = _int(body, "n", 1)
    if n != 1:
        raise RequestRefused(f"engine_sim supports n=1 only, got n={n}")
    stream_options = body.get("stream_options")
    include_usage = continuous_usage = False
    if stream_options is not None:
        if not isinstance(stream_options, dict):
            raise SchemaError("stream_options: Input should be a valid dictionary", "stream_options")
        include_usage = _bool(stream_options, "include_usage")
        continuous_usage = _bool(stream_options, "continuous_usage_stats")
    return GenRequest(
        kind=kind,
        model=model,
        prompt_tokens=prompt_tokens,
        max_new_tokens=max_new,
        stream=_bool(body, "stream"),
        include_usage=include_usage,
        continuous_usage=continuous_usage,
        ignore_eos=_bool(body, "ignore_eos"),
        rid=_str(body, "rid"),
        priority=_int(body, "priority"),
        bootstrap_host=_str(body, "bootstrap_host"),
        bootstrap_port=_int(body, "bootstrap_port"),
        bootstrap_room=_int(body, "bootstrap_room"),
        slo=_slo(body),
        resume=_resume(body),
        stream_key=content_key(content),
        prefix_blocks=prompt_blocks(content),
        predict_length=_bool(body, PREDICT_FIELD),
        local_prefill=_bool(body, LOCAL_PREFILL_FIELD),
        seed=seed,
        stops=stops,
        logprobs=logprobs,
    )


def load_json(raw: bytes) -> dict[str, Any]:
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise SchemaError(f"JSON decode error: {exc}") from None
    if not isinstance(body, dict):
        raise SchemaError("Input should be a valid dictionary or object to extract fields from")
    return body


def _model(body: dict[str, Any]) -> str:
    return _str(body, "model") or "default"  # CompletionRequest.model defaults to "default"


def _token_ids(v: list[Any], name: str) -> list[int]:
    if not all(_is_int(t) for t in v):
        raise SchemaError(f"{name}: Input should be a string or a list of integers", name)
    return v


# -- parsers -----------------------------------------------------------------------------------------------
def parse_completion(body: dict[str, Any]) -> GenRequest:
    """CompletionRequest (openai/protocol.py)."""
    if "prompt" not in body:
        raise SchemaError("prompt: Field required", "prompt")
    prompt = body["prompt"]
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
        prompt = prompt[0]  # a batch of one
    if not prompt or (isinstance(prompt, list) and all(not p for p in prompt)):
        raise RequestRefused("Prompt cannot be empty")  # OpenAIServingCompletion._validate_request
    if isinstance(prompt, list):
        if any(isinstance(p, str | list) for p in prompt):
            raise RequestRefused("engine_sim does not support batched prompts: send one prompt per request")
        prompt = _token_ids(prompt, "prompt")
    elif not isinstance(prompt, str):
        raise SchemaError("prompt: Input should be a valid string or list of token ids", "prompt")
    max_tokens = _int(body, "max_tokens", COMPLETIONS_DEFAULT_MAX_TOKENS)
    if max_tokens is not None and max_tokens <= 0:
        raise SchemaError("max_tokens: Value error, max_tokens must be positive", "max_tokens")
    return _common(body, "completion", _model(body), count_prompt(_COUNTER, prompt), max_tokens, prompt)


def parse_chat(body: dict[str, Any]) -> GenRequest:
    """ChatCompletionRequest (openai/protocol.py); max_completion_tokens wins over the deprecated max_tokens."""
    if "messages" not in body:
        raise SchemaError("messages: Field required", "messages")
    messages = body["messages"]
    if not isinstance(messages, list):
        raise SchemaError("messages: Input should be a valid list", "messages")
    if not messages:
        raise RequestRefused("Messages cannot be empty.")  # OpenAIServingChat._validate_request
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise SchemaError(f"messages.{i}: each message needs a string 'role'", f"messages.{i}")
        content = m.get("content")
        if content is not None and not isinstance(content, str | list):
            raise SchemaError(f"messages.{i}.content: Input should be a string or a list of parts",
                              f"messages.{i}.content")
    max_new = _int(body, "max_completion_tokens")
    if max_new is None:
        max_new = _int(body, "max_tokens")
    return _common(body, "chat", _model(body), count_chat(_COUNTER, messages), max_new, messages)


def parse_generate(body: dict[str, Any]) -> GenRequest:
    """GenerateReqInput (io_struct.py): text or input_ids, sampling_params.max_new_tokens / ignore_eos."""
    text = body.get("text")
    input_ids = body.get("input_ids")
    if (text is None) == (input_ids is None):
        raise RequestRefused("Either text, input_ids or input_embeds should be provided.")
    if text is not None:
        if isinstance(text, list):
            if len(text) != 1:
                raise RequestRefused("engine_sim does not support batched requests (text is a list)")
            text = text[0]
        if not isinstance(text, str):
            raise SchemaError("text: Input should be a valid string", "text")
        prompt_tokens = count_prompt(_COUNTER, text)
        content: Any = text
    else:
        if not isinstance(input_ids, list):
            raise SchemaError("input_ids: Input should be a valid list", "input_ids")
        if input_ids and isinstance(input_ids[0], list):
            if len(input_ids) != 1:
                raise RequestRefused("engine_sim does not support batched requests (input_ids is a list of lists)")
            input_ids = input_ids[0]
        prompt_tokens = len(_token_ids(input_ids, "input_ids"))
        content = input_ids
    sp = body.get("sampling_params") or {}
    if isinstance(sp, list):
        raise RequestRefused("engine_sim does not support batched requests (sampling_params is a list)")
    if not isinstance(sp, dict):
        raise SchemaError("sampling_params: Input should be a valid dictionary", "sampling_params")
    max_new = _int(sp, "max_new_tokens", DEFAULT_GENERATE_MAX_NEW_TOKENS)
    stops = _stop(sp)
    for name in ("temperature", "top_p"):
        _number(sp, name)
    n = _int(sp, "n", 1)
    if n != 1:
        raise RequestRefused(f"engine_sim supports n=1 only, got n={n}")
    for name in ("json_schema", "regex", "ebnf", "structural_tag"):
        if sp.get(name) is not None:
            raise RequestRefused(f"engine_sim cannot constrain its placeholder text: sampling_params.{name} needs a "
                                 "real engine (SGLang's grammar backend)")
    gen = _common({k: v for k, v in body.items() if k not in ("n", "stop", "temperature", "top_p")}, "generate",
                  "default", prompt_tokens, max_new, content)
    gen.ignore_eos = _bool(sp, "ignore_eos")
    gen.stops = stops
    return gen


# -- errors ------------------------------------------------------------------------------------------------
def error_body(message: str, err_type: str, code: int, param: str | None = None) -> dict[str, Any]:
    """ErrorResponse (openai/protocol.py)."""
    return {"object": "error", "message": message, "type": err_type, "param": param, "code": code}


def stream_error_chunk(message: str, status: int) -> bytes:
    """create_streaming_error_response: ``{"error": ErrorResponse}`` with the status' name as type, serialized by
    ``json.dumps`` (its ", " and ": " separators, unlike the other chunks)."""
    return b"data: " + json.dumps({"error": error_body(message, HTTPStatus(status).name, status)}).encode() + b"\n\n"


DONE = b"data: [DONE]\n\n"


# -- /generate ------------------------------------------------------------------------------------------------
def generate_output(req: SimRequest, text: str, n_ids: int, finish: dict[str, Any] | None) -> dict[str, Any]:
    """One /generate output (non-streaming, or one stream chunk: text and output_ids are cumulative, as SGLang
    sends them unless --incremental-streaming-output)."""
    meta: dict[str, Any] = {
        "id": req.rid,
        "finish_reason": _finish_json(finish),
        "prompt_tokens": req.prompt_tokens,
        "weight_version": WEIGHT_VERSION,
        "num_retractions": req.num_retractions,
        "reasoning_tokens": 0,
        "completion_tokens": n_ids,
        "cached_tokens": req.cached_tokens,
    }
    if finish is not None:
        meta["e2e_latency"] = clock.monotonic() - req.received_s
    return {"text": text, "output_ids": req.output_ids[:n_ids], "meta_info": meta}


def _finish_json(finish: dict[str, Any] | None) -> dict[str, Any] | None:
    if finish is None or finish.get("status_code") is None:
        return finish
    return {**finish, "status_code": int(finish["status_code"])}


# -- OpenAI ------------------------------------------------------------------------------------------------
def usage(prompt_tokens: int, completion_tokens: int, *, exclude_none: bool = False,
          cached_tokens: int | None = None) -> dict[str, Any]:
    """UsageInfo as UsageProcessor.calculate_token_usage builds it (no reasoning tokens); ``cached_tokens``
    (with --enable-cache-report) becomes ``prompt_tokens_details``."""
    u: dict[str, Any] = {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens + completion_tokens,
                         "completion_tokens": completion_tokens}
    details = {"cached_tokens": cached_tokens} if cached_tokens is not None else None
    if exclude_none:
        if details is not None:
            u["prompt_tokens_details"] = details
        u["reasoning_tokens"] = 0
        return u
    u.update({"prompt_tokens_details": details, "reasoning_tokens": 0, "completion_tokens_details": None})
    return u


def matched_stop(finish: dict[str, Any] | None) -> int | str | None:
    return finish.get("matched") if finish else None


def completion_response(req: SimRequest, model: str, text: str, cached_tokens: int | None = None,
                        logprobs: int | None = None) -> dict[str, Any]:
    """CompletionResponse (non-streaming); ``logprobs``: the alternatives a token asked for (None: none)."""
    return {
        "id": req.rid,
        "object": "text_completion",
        "created": int(time.time()),
        "model": model,
        "choices": [{"index": 0, "text": text,
                     "logprobs": None if logprobs is None else completion_logprobs(req.output_ids, logprobs),
                     "finish_reason": req.finish["type"] if req.finish else None,
                     "matched_stop": matched_stop(req.finish)}],
        "usage": usage(req.prompt_tokens, len(req.output_ids), cached_tokens=cached_tokens),
        "metadata": metadata(len(req.output_ids)),
    }


def metadata(output_tokens: int) -> dict[str, Any]:
    """A response's ``metadata``: the weight version, and which output tokens it produced (one version here;
    recorded from SGLang 0.5.23: tests/contract/fixtures/sglang-0.5.23-cpu/completion.json)."""
    return {"weight_version": WEIGHT_VERSION,
            "weight_versions": [{"version": WEIGHT_VERSION, "start": 0, "end": output_tokens}]}


def completion_chunk(rid: str, created: int, model: str, text: str, finish: dict[str, Any] | None,
                     chunk_usage: dict[str, Any] | None = None, prediction: float | None = None,
                     logprobs: dict[str, Any] | None = None) -> bytes:
    """CompletionStreamResponse.model_dump_json(): nulls included, sglext dropped; ``chunk_usage`` with
    ``stream_options.continuous_usage_stats``; ``logprobs`` (the chunk's tokens') where asked for."""
    return b"data: " + orjson.dumps({
        "id": rid, "object": "text_completion", "created": created, "model": model,
        "choices": [{"index": 0, "text": text, "logprobs": logprobs,
                     "finish_reason": finish["type"] if finish else None, "matched_stop": matched_stop(finish)}],
        "usage": chunk_usage,
        **({PREDICTION_FIELD: prediction} if prediction is not None else {}),
    }) + b"\n\n"


def completion_usage_chunk(rid: str, created: int, model: str, prompt_tokens: int, completion_tokens: int,
                           cached_tokens: int | None = None) -> bytes:
    """The final usage chunk: model_dump_json(exclude_none=True), empty choices."""
    return b"data: " + orjson.dumps({
        "id": rid, "object": "text_completion", "created": created, "model": model, "choices": [],
        "usage": usage(prompt_tokens, completion_tokens, exclude_none=True, cached_tokens=cached_tokens),
    }) + b"\n\n"


def chat_response(req: SimRequest, model: str, text: str, cached_tokens: int | None = None,
                  logprobs: int | None = None) -> dict[str, Any]:
    """ChatCompletionResponse (non-streaming); ``logprobs``: the alternatives a token asked for (None: none)."""
    return {
        "id": req.rid,
        "object": "chat.completion",
        "created": int(time.time()),
        "model": model,
        "choices": [{"index": 0, "message": {"role": "assistant", "content": text, "reasoning_content": None},
                     "logprobs": None if logprobs is None else chat_logprobs(req.output_ids, logprobs),
                     "finish_reason": req.finish["type"] if req.finish else None,
                     "matched_stop": matched_stop(req.finish)}],
        "usage": usage(req.prompt_tokens, len(req.output_ids), cached_tokens=cached_tokens),
        "metadata": metadata(len(req.output_ids)),
    }


def chat_chunk(rid: str, created: int, model: str, *, role: str | None = None, content: str | None = None,
               finish: dict[str, Any] | None = None, chunk_usage: dict[str, Any] | None = None,
               prediction: float | None = None, logprobs: dict[str, Any] | None = None) -> bytes:
    """build_sse_content (openai/sse_utils.py): delta omits unset role/content but always has reasoning_content;
    ``chunk_usage`` (``stream_options.continuous_usage_stats``) rides on content chunks, ``logprobs`` (the
    chunk's tokens') where the request asked for them."""
    delta: dict[str, Any] = {"reasoning_content": None}
    if role is not None:
        delta["role"] = role
    if content is not None:
        delta["content"] = content
    return b"data: " + orjson.dumps({
        "id": rid, "object": "chat.completion.chunk", "created": created, "model": model,
        "choices": [{"index": 0, "delta": delta, "logprobs": logprobs,
                     "finish_reason": finish["type"] if finish else None, "matched_stop": matched_stop(finish)}],
        **({"usage": chunk_usage} if chunk_usage is not None else {}),
        **({PREDICTION_FIELD: prediction} if prediction is not None else {}),
    }) + b"\n\n"


def chat_usage_chunk(rid: str, created: int, model: str, prompt_tokens: int, completion_tokens: int,
                     cached_tokens: int | None = None) -> bytes:
    """ChatCompletionStreamResponse with usage, model_dump_json() (nulls kept)."""
    return b"data: " + orjson.dumps({
        "id": rid, "object": "chat.completion.chunk", "created": created, "model": model, "choices": [],
        "usage": usage(prompt_tokens, completion_tokens, cached_tokens=cached_tokens),
    }) + b"\n\n"


def model_card(model: str, max_model_len: int) -> dict[str, Any]:
    """ModelCard (openai/protocol.py)."""
    return {"id": model, "object": "model", "created": int(time.time()), "owned_by": "sglang", "root": model,
            "parent": None, "max_model_len": max_model_len}
