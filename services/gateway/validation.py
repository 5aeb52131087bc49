"""Parse and validate OpenAI completion and chat requests before anything is dispatched.

Hand-written rather than pydantic models: every rule gives the OpenAI error a client expects (message,
``param``), unknown fields pass through to the engine untouched (SGLang accepts many extensions), and it
stays cheap on the hot path.
"""

from __future__ import annotations

import math
from typing import Any, Literal

import msgspec
import orjson

from services.gateway.errors import APIError, bad_request
from services.gateway.slo import ResolvedSlo, SloTable
from shared.protocol.openai_api import COMPLETIONS_DEFAULT_MAX_TOKENS
from shared.tokens import TokenCounter, count_chat, count_prompt

Endpoint = Literal["completions", "chat"]
CHAT_ROLES = frozenset({"system", "user", "assistant", "tool", "developer", "function"})


class ParsedRequest(msgspec.Struct, kw_only=True):
    endpoint: Endpoint
    body: dict[str, Any]  # the client's body, normalised, forwarded to the engines
    model: str
    stream: bool
    include_usage: bool
    # The output limit: the client's, or for a chat request that gave none the length the gateway plans
    # with (its ledger, placement), while the engines get no limit (``limited`` False) and answer to the end.
    max_tokens: int
    input_tokens: int
    priority: int | None  # SGLang's field: forwarded to every engine unchanged
    slo: ResolvedSlo | None = None  # the request's SLO class and targets (services/gateway/slo.py)
    limited: bool = True  # the engines get ``max_tokens`` as the request's limit
    retries: int = 0  # the client's earlier sends of this request (its X-Stainless-Retry-Count)

    def remaining_tokens(self, generated: int) -> int:
        """Output tokens still to come after ``generated``, as the gateway plans for them (at least 1 while an
        unlimited request runs on)."""
        left = self.max_tokens - generated
        return left if self.limited else max(left, 1)


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


# The largest integer JSON carries exactly everywhere (RFC 7493's I-JSON; a JSON Schema bound is a float):
# integer fields are held to it, so a value the document allows is one every parser reads the same.
MAX_JSON_INT = 2**53 - 1


def _is_json_int(v: Any) -> bool:
    return _is_int(v) and -MAX_JSON_INT <= v <= MAX_JSON_INT


def _whole(v: Any) -> Any:
    """``v`` as an int when it is a whole-number float that fits 64 bits (JSON Schema's integer, and SGLang's
    pydantic, take 10.0 as 10), else unchanged."""
    # Within 64 bits only: the body is re-encoded for the engines, and JSON encoders stop there.
    return int(v) if isinstance(v, float) and v.is_integer() and abs(v) < 2.0**63 else v


def _integer_field(body: dict[str, Any], name: str, default: Any = None) -> Any:
    """The field's value, a whole-number float turned into the int the engines get."""
    v = _whole(body.get(name, default))
    if name in body:
        body[name] = v
    return v


def _number(body: dict[str, Any], name: str, lo: float, hi: float) -> None:
    v = body.get(name)
    if v is None:
        return
    if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v) or not lo <= v <= hi:
        raise bad_request(f"'{name}' must be a number between {lo:g} and {hi:g}, got {v!r}", param=name)


def _prompt(body: dict[str, Any]) -> str | list[int]:
    prompt = body.get("prompt")
    if prompt is None:
        raise bad_request("'prompt' is required", param="prompt")
    if isinstance(prompt, str):
        if not prompt:
            raise bad_request("'prompt' must not be empty", param="prompt")
        return prompt
    if isinstance(prompt, list) and prompt:
        if any(isinstance(t, float) for t in prompt):
            prompt = body["prompt"] = [_whole(t) for t in prompt]
        if all(_is_int(t) for t in prompt):
            if any(not 0 <= t <= MAX_JSON_INT for t in prompt):
                raise bad_request(f"token ids in 'prompt' must be integers from 0 to {MAX_JSON_INT}", param="prompt")
            return prompt
        if all(isinstance(t, int | float) and not isinstance(t, bool) for t in prompt):
            raise bad_request("token ids in 'prompt' must be integers", param="prompt")
        if len(prompt) == 1 and isinstance(prompt[0], str | list):
            body["prompt"] = prompt[0]
            return _prompt(body)
        raise bad_request("batched prompts are not supported: send one prompt (a string or a list of token ids) "
                          "per request", param="prompt")
    raise bad_request("'prompt' must be a non-empty string or a list of token ids", param="prompt")


def json_depth(value: Any) -> int:
    """How deeply objects and lists nest in ``value`` (a scalar is 0), without recursion."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        v, depth = stack.pop()
        children = v.values() if isinstance(v, dict) else v if isinstance(v, list) else None
        if children is None:
            continue
        deepest = max(deepest, depth)
        # The element types first, at C speed: a token-id prompt (a million ints) is not walked in Python.
        if not _CONTAINERS.isdisjoint(set(map(type, children))):
            stack.extend((c, depth + 1) for c in children if isinstance(c, dict | list))
    return deepest


_CONTAINERS = frozenset({dict, list})


def _messages(body: dict[str, Any]) -> list[dict[str, Any]]:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise bad_request("'messages' must be a non-empty list", param="messages")
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise bad_request(f"messages[{i}] must be an object", param=f"messages.[{i}]")
        role = m.get("role")
        if not isinstance(role, str) or role not in CHAT_ROLES:
            raise bad_request(f"messages[{i}].role must be one of {', '.join(sorted(CHAT_ROLES))}, got {m.get('role')!r}",
                              param=f"messages.[{i}].role")
        content = m.get("content")
        if content is None and m.get("role") == "assistant":
            continue
        if isinstance(content, list):
            if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str) for p in content):
                raise bad_request(f"messages[{i}].content parts must be text parts ({{'type': 'text', 'text': ...}})",
                                  param=f"messages.[{i}].content")
        elif not isinstance(content, str):
            raise bad_request(f"messages[{i}].content must be a string or a list of text parts",
                              param=f"messages.[{i}].content")
    return messages


RESPONSE_FORMATS = ("text", "json_object", "json_schema", "structural_tag")  # OpenAI's three and SGLang's own
TOOL_CHOICES = ("none", "auto", "required")


def _response_format(fmt: Any) -> None:
    if fmt is None:
        return
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind not in RESPONSE_FORMATS:
        raise bad_request(f"'response_format' must be an object whose 'type' is one of {', '.join(RESPONSE_FORMATS)}, "
                          f"got {fmt!r}", param="response_format")
    if kind == "json_schema":
        schema = fmt.get("json_schema")
        if not isinstance(schema, dict) or not isinstance(schema.get("name"), str) or (
                schema.get("schema") is not None and not isinstance(schema["schema"], dict)):
            raise bad_request("'response_format.json_schema' must be an object with a string 'name' and a 'schema' "
                              "object", param="response_format.json_schema")


def _tools(tools: Any, choice: Any) -> None:
    names: set[str] = set()
    if tools is not None:
        if not isinstance(tools, list):
            raise bad_request("'tools' must be a list of tools", param="tools")
        for i, tool in enumerate(tools):
            function = tool.get("function") if isinstance(tool, dict) else None
            if not isinstance(function, dict) or not isinstance(function.get("name"), str) or not function["name"]:
                raise bad_request(f"tools[{i}] must be {{'type': 'function', 'function': {{'name': ...}}}}",
                                  param=f"tools.[{i}]")
            names.add(function["name"])
    if choice is None or choice == "none":
        return
    named: str | None = None
    if isinstance(choice, dict):
        function = choice.get("function")
        named = function.get("name") if isinstance(function, dict) else None
        if not isinstance(named, str):
            raise bad_request("'tool_choice' as an object must be {'type': 'function', 'function': {'name': ...}}",
                              param="tool_choice")
    elif choice not in TOOL_CHOICES:
        raise bad_request(f"'tool_choice' must be one of {', '.join(TOOL_CHOICES)} or a named function, "
                          f"got {choice!r}", param="tool_choice")
    if not names:
        raise bad_request(f"'tool_choice' {choice!r} needs 'tools'", param="tool_choice")
    if named is not None and named not in names:
        raise bad_request(f"'tool_choice' names the function {named!r}, which is not among 'tools'",
                          param="tool_choice")


_EMPTY_TABLE = SloTable()


def _body(raw: bytes, max_depth: int) -> dict[str, Any]:
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise bad_request(f"request body is not valid JSON: {exc}") from None
    if not isinstance(body, dict):
        raise bad_request("request body must be a JSON object")
    depth = json_depth(body)
    if depth > max_depth:
        # every field goes to the engines re-encoded; a deep one would exhaust the encoder's recursion
        raise bad_request(f"request body nests {depth} levels deep; at most {max_depth} are accepted")
    return body


def _output_limit(body: dict[str, Any], endpoint: Endpoint, default_max_tokens: int,
                  max_tokens_limit: int) -> tuple[int, bool]:
    """The output limit and whether the engines get it (``body`` is normalised to ``max_tokens``)."""
    max_name = "max_completion_tokens" if endpoint == "chat" and body.get("max_completion_tokens") is not None \
        else "max_tokens"
    max_tokens = body.get(max_name)
    limited = True
    if max_tokens is None and endpoint == "completions":
        max_tokens = COMPLETIONS_DEFAULT_MAX_TOKENS
    elif max_tokens is None:
        # As OpenAI and SGLang: a chat answer without a limit runs to its end (or the context's); the gateway
        # plans with default_max_tokens for it.
        max_tokens, limited = default_max_tokens, False
    elif not _is_int(max_tokens := _whole(max_tokens)) or max_tokens < 1:
        raise bad_request(f"'{max_name}' must be a positive integer, got {max_tokens!r}", param=max_name)
    if max_tokens > max_tokens_limit:
        raise bad_request(f"'{max_name}' is {max_tokens}, above this deployment's limit of {max_tokens_limit}",
                          param=max_name)
    body.pop("max_completion_tokens", None)
    if limited:
        body["max_tokens"] = max_tokens
    return max_tokens, limited


def _streaming(body: dict[str, Any]) -> tuple[bool, bool]:
    """``stream`` and ``stream_options.include_usage``."""
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise bad_request("'stream' must be a boolean", param="stream")
    options = body.get("stream_options")
    if options is None:
        return stream, False
    if not isinstance(options, dict) or not isinstance(options.get("include_usage", False), bool):
        raise bad_request("'stream_options' must be an object like {\"include_usage\": true}", param="stream_options")
    if not stream:
        raise bad_request("'stream_options' is only allowed when 'stream' is true", param="stream_options")
    return stream, bool(options.get("include_usage", False))


def _sampling(body: dict[str, Any], endpoint: Endpoint) -> None:
    """The sampling fields' types and the OpenAI API's bounds."""
    _number(body, "temperature", 0.0, 2.0)
    _number(body, "top_p", 0.0, 1.0)
    _number(body, "presence_penalty", -2.0, 2.0)
    _number(body, "frequency_penalty", -2.0, 2.0)
    stop = body.get("stop")
    if stop is not None:
        stops = [stop] if isinstance(stop, str) else stop
        if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops) or len(stops) > 4:
            raise bad_request("'stop' must be a non-empty string or a list of up to 4 non-empty strings", param="stop")
    n = _integer_field(body, "n", 1)
    if not _is_int(n) or n < 1:
        raise bad_request(f"'n' must be a positive integer, got {n!r}", param="n")
    if n != 1:
        raise bad_request("'n' > 1 is not supported: send separate requests", param="n")
    for flag in ("ignore_eos", "echo") if endpoint == "completions" else ("ignore_eos", "logprobs"):
        if body.get(flag) is not None and not isinstance(body[flag], bool):
            raise bad_request(f"'{flag}' must be a boolean", param=flag)
    # The OpenAI API's bounds: completions take up to 5 log-probabilities a token, chat up to 20.
    name, most = ("logprobs", 5) if endpoint == "completions" else ("top_logprobs", 20)
    count = _integer_field(body, name)
    if count is not None and (not _is_int(count) or not 0 <= count <= most):
        raise bad_request(f"'{name}' must be an integer from 0 to {most}, got {count!r}", param=name)
    if endpoint == "chat" and body.get("top_logprobs") and body.get("logprobs") is not True:
        raise bad_request("'top_logprobs' needs 'logprobs' set to true", param="top_logprobs")
    # Checked here, so a bad value is a 400 naming it rather than an engine's error naming an engine.
    seed = _integer_field(body, "seed")
    if seed is not None and not _is_json_int(seed):
        raise bad_request(f"'seed' must be an integer of at most {MAX_JSON_INT} in size, got {seed!r}", param="seed")
    user = body.get("user")
    if user is not None and not isinstance(user, str):
        raise bad_request(f"'user' must be a string, got {type(user).__name__}", param="user")


def parse_request(raw: bytes, endpoint: Endpoint, *, counter: TokenCounter, default_max_tokens: int,
                  max_tokens_limit: int, slo_table: SloTable | None = None, max_depth: int = 64) -> ParsedRequest:
    """Validate a request body; raises :class:`APIError` (400) naming the offending parameter.

    The Poise extension fields ``slo`` and ``slo_class`` are resolved with ``slo_table`` (no classes when
    None) and removed from the body that goes to the engines.
    """
    body = _body(raw, max_depth)
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise bad_request("'model' is required and must be a string", param="model")
    if endpoint == "completions":
        input_tokens = count_prompt(counter, _prompt(body))
    else:
        input_tokens = count_chat(counter, _messages(body))
    max_tokens, limited = _output_limit(body, endpoint, default_max_tokens, max_tokens_limit)
    stream, include_usage = _streaming(body)
    _sampling(body, endpoint)
    _response_format(body.get("response_format"))
    if endpoint == "chat":
        _tools(body.get("tools"), body.get("tool_choice"))
    priority = _integer_field(body, "priority")
    if priority is not None and not _is_json_int(priority):
        raise bad_request(f"'priority' must be an integer of at most {MAX_JSON_INT} in size", param="priority")
    slo = (slo_table or _EMPTY_TABLE).resolve(body, model=model, endpoint=endpoint, priority=priority)
    return ParsedRequest(endpoint=endpoint, body=body, model=model, stream=stream, include_usage=include_usage,
                         max_tokens=max_tokens, input_tokens=input_tokens, priority=priority, slo=slo, limited=limited)


def model_not_found(model: str, served: list[str]) -> APIError:
    names = ", ".join(served) if served else "none (no engine registered yet)"
    return APIError(404, f"The model '{model}' does not exist or is not served here. Served models: {names}",
                    param="model", code="model_not_found")


def seed_not_applied(model: str) -> APIError:
    return bad_request(f"'seed' is not applied by the engines serving '{model}': they sample without a per-request "
                       "seed (SGLang applies one only when started with --enable-deterministic-inference), so the "
                       "answer would not be repeatable; leave 'seed' out", param="seed")
