"""The OpenAPI description of what the gateway serves, for schema-driven clients and fuzzers.

The inference routes read their bodies by hand (services/gateway/validation.py: every rule gives the OpenAI
error a client expects, unknown fields pass through to the engines), so FastAPI cannot infer their schemas.
These models describe the same contract for the served ``/openapi.json``: the fields the gateway checks, with
their bounds, and ``additionalProperties`` left open for the engine's own; the answers as JSON or as a
server-sent event stream; and the OpenAI error body on every status the gateway answers with. They are never
used to parse a request.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from services.gateway.validation import CHAT_ROLES, MAX_JSON_INT, RESPONSE_FORMATS, TOOL_CHOICES

_OPEN = ConfigDict(extra="allow")  # unknown fields go to the engines unchanged
JsonInt = Annotated[int, Field(ge=-MAX_JSON_INT, le=MAX_JSON_INT)]
ChatRole = Literal[tuple(sorted(CHAT_ROLES - {"assistant"}))]  # type: ignore[valid-type]  # AssistantTurn has its own


class StreamOptions(BaseModel):
    include_usage: bool = False


class SloTargets(BaseModel):
    """Poise's per-request targets (the gateway's SLO table resolves the rest)."""

    model_config = ConfigDict(extra="forbid")
    ttft_s: float | None = Field(None, gt=0.0, description="Seconds to the first token (at least one prefill pass).")
    tpot_s: float | None = Field(None, gt=0.0, description="Seconds a token after the first.")
    name: str | None = Field(None, pattern=r"^[A-Za-z0-9_.-]+$", description="A label for the metrics.")


class JsonSchemaFormat(BaseModel):
    model_config = _OPEN
    name: str
    schema_: dict[str, Any] | None = Field(None, alias="schema")


class JsonSchemaResponse(BaseModel):
    model_config = _OPEN
    type: Literal["json_schema"]
    json_schema: JsonSchemaFormat


class OtherResponseFormat(BaseModel):
    model_config = _OPEN
    type: Literal[tuple(f for f in RESPONSE_FORMATS if f != "json_schema")]  # type: ignore[valid-type]


NonEmpty = Annotated[str, Field(min_length=1)]


class _Sampling(BaseModel):
    model_config = _OPEN
    model: str = Field(min_length=1, description="A model the cluster serves (GET /v1/models).")
    stream: bool = Field(False, description="Answer as server-sent events (text/event-stream), ending with [DONE].")
    stream_options: StreamOptions | None = Field(None, description="Only with stream: true (a 400 otherwise).")
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, ge=0.0, le=1.0)
    presence_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    stop: NonEmpty | Annotated[list[NonEmpty], Field(max_length=4)] | None = Field(
        None, description="Up to 4 non-empty strings; the answer ends before one.")
    n: Literal[1] = Field(1, description="One choice per request.")
    seed: JsonInt | None = Field(None, description="Refused (400) where the model's engines would not apply it.")
    user: str | None = None
    ignore_eos: bool | None = Field(None, description="SGLang's: generate to max_tokens.")
    priority: JsonInt | None = Field(None, description="SGLang's priority, forwarded to the engines.")
    slo_class: NonEmpty | None = Field(None, description="Poise: a named SLO class of this deployment.")
    slo: SloTargets | None = Field(None, description="Poise: this request's own targets.")
    response_format: JsonSchemaResponse | OtherResponseFormat | None = Field(
        None, description=f"{{'type': ...}}, one of {', '.join(RESPONSE_FORMATS)}; json_schema needs "
                          "{'json_schema': {'name': ..., 'schema': {...}}}.")


TokenId = Annotated[int, Field(ge=0, le=MAX_JSON_INT)]


class CompletionRequest(_Sampling):
    prompt: NonEmpty | Annotated[list[TokenId], Field(min_length=1)] | Annotated[
        list[NonEmpty], Field(min_length=1, max_length=1)] = Field(
        description="A non-empty string or a list of token ids (one prompt; a list of one string is that string).")
    max_tokens: int | None = Field(None, ge=1, description="Output limit; absent: 16, as the OpenAI API.")
    logprobs: int | None = Field(None, ge=0, le=5)
    echo: bool | None = None


class TextPart(BaseModel):
    model_config = _OPEN
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = _OPEN
    role: ChatRole  # type: ignore[valid-type]
    content: str | list[TextPart] = Field(description="A string or text parts {'type': 'text', 'text'}.")


class AssistantTurn(BaseModel):
    """An earlier assistant turn: its content may be null (a turn that only called tools)."""

    model_config = _OPEN
    role: Literal["assistant"]
    content: str | list[TextPart] | None = None


class FunctionName(BaseModel):
    model_config = _OPEN
    name: NonEmpty


class Tool(BaseModel):
    model_config = _OPEN
    function: FunctionName


class NamedToolChoice(BaseModel):
    model_config = _OPEN
    function: FunctionName


class ChatCompletionRequest(_Sampling):
    messages: list[AssistantTurn | ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1, description="Output limit; absent: the answer runs to its end.")
    max_completion_tokens: int | None = Field(None, ge=1, description="Wins over max_tokens.")
    logprobs: bool | None = None
    top_logprobs: int | None = Field(None, ge=0, le=20, description="Only with logprobs: true (a 400 otherwise).")
    tools: list[Tool] | None = Field(None, description="Functions: {'type': 'function', 'function': {'name'}}.")
    tool_choice: Literal[TOOL_CHOICES] | NamedToolChoice | None = Field(  # type: ignore[valid-type]
        None, description=f"One of {', '.join(TOOL_CHOICES)}, or {{'type': 'function', 'function': {{'name'}}}} "
                          "naming one of tools; anything but none needs tools.")


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: dict[str, int] | None = None


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: dict[str, Any] | None
    finish_reason: str | None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None


class AssistantMessage(BaseModel):
    role: Literal["assistant"]
    content: str | None


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: dict[str, Any] | None
    finish_reason: str | None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage | None


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorResponse(BaseModel):
    error: ErrorDetail


class ModelCard(BaseModel):
    id: str
    object: Literal["model"]
    created: int
    owned_by: str


class ModelList(BaseModel):
    object: Literal["list"]
    data: list[ModelCard]


def _errors(*statuses: int) -> dict[int | str, dict[str, Any]]:
    why = {400: "A field is invalid (param names it).", 401: "Missing or wrong API key.",
           404: "The model is not served here.", 408: "The body did not arrive in time.",
           413: "The body is over the limit.", 415: "The body is not application/json.",
           429: "Refused under load: retry after Retry-After.", 503: "No engine can serve it now."}
    return {s: {"model": ErrorResponse, "description": why[s]} for s in statuses}


_SSE = {"text/event-stream": {"schema": {"type": "string", "description": (
    "With stream: true. Each event is 'data: <chunk JSON>' (chat.completion.chunk or text_completion), the last "
    "'data: [DONE]'; an error after the first token comes as a 'data: {\"error\": ...}' event.")}}}


def inference_route(request: type[BaseModel], response: type[BaseModel]) -> dict[str, Any]:
    """``add_api_route`` keywords that document an inference route."""
    body = request.model_json_schema(ref_template="#/components/schemas/{model}")
    body.pop("$defs", None)  # in components.schemas (component_schemas)
    return {
        "responses": {200: {"model": response, "description": "The answer (JSON), or its stream (SSE).",
                            "content": _SSE},
                      **_errors(400, 401, 404, 408, 413, 415, 429, 503)},
        "openapi_extra": {"requestBody": {"required": True, "content": {"application/json": {"schema": body}}}},
    }


def component_schemas() -> dict[str, Any]:
    """The request models' nested schemas, for ``components.schemas`` (the request bodies refer to them)."""
    out: dict[str, Any] = {}
    for model in (CompletionRequest, ChatCompletionRequest):
        out.update(model.model_json_schema(ref_template="#/components/schemas/{model}").get("$defs", {}))
    return out


class Health(BaseModel):
    model_config = _OPEN
    status: Literal["ok", "degraded", "unavailable", "draining"]


@dataclass(frozen=True, slots=True)
class DeploymentBounds:
    """The limits the gateway's validator takes from its settings, which the served document states too."""

    max_tokens_limit: int  # the largest max_tokens a request may ask for
    min_ttft_s: float  # the smallest slo.ttft_s (one prefill pass of these engines)
    slo_classes: tuple[str, ...]  # the slo_class names this deployment defines


def _value_branch(prop: dict[str, Any]) -> dict[str, Any]:
    """The non-null alternative of an optional property's schema (the property itself when not optional)."""
    return next((b for b in prop.get("anyOf", []) if b.get("type") != "null"), prop)


def _state_bounds(schema: dict[str, Any], bounds: DeploymentBounds) -> None:
    for path in ("/v1/completions", "/v1/chat/completions"):
        body = schema["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"]
        props = body["properties"]
        for name in ("max_tokens", "max_completion_tokens"):
            if name in props:
                _value_branch(props[name])["maximum"] = bounds.max_tokens_limit
        body["allOf"] = _CROSS_FIELD[path]
        if bounds.slo_classes:
            _value_branch(props["slo_class"])["enum"] = list(bounds.slo_classes)
        else:  # no class defined: any name is refused
            props["slo_class"]["anyOf"] = [{"type": "null"}]
    ttft = schema["components"]["schemas"]["SloTargets"]["properties"]["ttft_s"]
    _value_branch(ttft)["minimum"] = bounds.min_ttft_s


def _present(name: str, value: dict[str, Any]) -> dict[str, Any]:
    """JSON Schema for "the body has ``name`` and its value matches ``value``"."""
    return {"required": [name], "properties": {name: value}}


#: The validator's rules across fields, as JSON Schema 2020-12 conditions (OpenAPI 3.1).
_CROSS_FIELD: dict[str, list[dict[str, Any]]] = {
    "/v1/completions": [
        {"if": _present("stream_options", {"type": "object"}), "then": _present("stream", {"const": True})},
    ],
    "/v1/chat/completions": [
        {"if": _present("stream_options", {"type": "object"}), "then": _present("stream", {"const": True})},
        {"if": _present("top_logprobs", {"type": "integer", "minimum": 1}), "then": _present("logprobs", {"const": True})},
        {"if": _present("tool_choice", {"not": {"anyOf": [{"type": "null"}, {"const": "none"}]}}),
         "then": _present("tools", {"type": "array", "minItems": 1})},
    ],
}


def finish_document(schema: dict[str, Any], bounds: DeploymentBounds) -> dict[str, Any]:
    """The generated document with the request models' schemas in ``components``, this deployment's bounds
    (``bounds``) stated, and FastAPI's 422 gone: a body or parameter the gateway refuses is a 400 with the
    OpenAI error body (listed on each route). Rules across fields are conditions (``stream_options`` only with
    ``stream``, ``top_logprobs`` only with ``logprobs``, a ``tool_choice`` other than none only with ``tools``);
    that a named ``tool_choice`` names one of ``tools`` JSON Schema cannot say, so its description does."""
    components = schema.setdefault("components", {}).setdefault("schemas", {})
    components.update(component_schemas())
    for operations in schema.get("paths", {}).values():
        for operation in operations.values():
            operation.get("responses", {}).pop("422", None)
    for name in ("HTTPValidationError", "ValidationError"):
        components.pop(name, None)
    _state_bounds(schema, bounds)
    return schema


HEALTH_ROUTE: dict[str, Any] = {"responses": {
    200: {"model": Health, "description": "A request can be served."},
    503: {"model": Health, "description": "No request can be served now (the body says why)."}}}
MODEL_ROUTES: dict[str, Any] = {"responses": {200: {"model": ModelList}, **_errors(401)}}
MODEL_ROUTE: dict[str, Any] = {"responses": {200: {"model": ModelCard}, **_errors(401, 404)}}
METRICS_ROUTE: dict[str, Any] = {"responses": {200: {
    "description": "Prometheus text exposition.", "content": {"text/plain": {"schema": {"type": "string"}}}}}}
