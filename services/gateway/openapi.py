"""The OpenAPI description of what the gateway serves, for schema-driven clients and fuzzers.

The inference routes read their bodies by hand (services/gateway/validation.py: every rule gives the OpenAI
error a client expects, unknown fields pass through to the engines), so FastAPI cannot infer their schemas.
These models describe the same contract for the served ``/openapi.json``: the fields the gateway checks, with
their bounds, and ``additionalProperties`` left open for the engine's own; the answers as JSON or as a
server-sent event stream; and the OpenAI error body on every status the gateway answers with. They are never
used to parse a request.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from services.gateway.validation import CHAT_ROLES, RESPONSE_FORMATS, TOOL_CHOICES

_OPEN = ConfigDict(extra="allow")  # unknown fields go to the engines unchanged
ChatRole = Literal[tuple(sorted(CHAT_ROLES))]  # type: ignore[valid-type]


class StreamOptions(BaseModel):
    include_usage: bool = False


class _Sampling(BaseModel):
    model_config = _OPEN
    model: str = Field(min_length=1, description="A model the cluster serves (GET /v1/models).")
    stream: bool = Field(False, description="Answer as server-sent events (text/event-stream), ending with [DONE].")
    stream_options: StreamOptions | None = Field(None, description="Only with stream: true.")
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, ge=0.0, le=1.0)
    presence_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    stop: str | list[str] | None = Field(None, description="Up to 4 non-empty strings; the answer ends before one.")
    n: Literal[1] = Field(1, description="One choice per request.")
    seed: int | None = Field(None, description="Refused (400) where the model's engines would not apply it.")
    user: str | None = None
    ignore_eos: bool | None = Field(None, description="SGLang's: generate to max_tokens.")
    priority: int | None = Field(None, description="SGLang's priority, forwarded to the engines.")
    slo_class: str | None = Field(None, description="Poise: a named SLO class of this deployment.")
    slo: dict[str, float] | None = Field(None, description="Poise: this request's own targets, {ttft_s, tpot_s}.")
    response_format: dict[str, Any] | None = Field(
        None, description=f"{{'type': ...}}, one of {', '.join(RESPONSE_FORMATS)}; json_schema needs "
                          "{'json_schema': {'name': ..., 'schema': {...}}}.")


class CompletionRequest(_Sampling):
    prompt: str | list[int] = Field(description="A non-empty string or a list of token ids (one prompt).")
    max_tokens: int | None = Field(None, ge=1, description="Output limit; absent: 16, as the OpenAI API.")
    logprobs: int | None = Field(None, ge=0, le=5)
    echo: bool | None = None


class ChatMessage(BaseModel):
    model_config = _OPEN
    role: ChatRole  # type: ignore[valid-type]
    content: str | list[dict[str, Any]] | None = Field(description="A string or text parts {'type': 'text', 'text'}.")


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1, description="Output limit; absent: the answer runs to its end.")
    max_completion_tokens: int | None = Field(None, ge=1, description="Wins over max_tokens.")
    logprobs: bool | None = None
    top_logprobs: int | None = Field(None, ge=0, le=20, description="Only with logprobs: true.")
    tools: list[dict[str, Any]] | None = Field(None, description="Functions: {'type': 'function', 'function': {'name'}}.")
    tool_choice: str | dict[str, Any] | None = Field(
        None, description=f"One of {', '.join(TOOL_CHOICES)}, or {{'type': 'function', 'function': {{'name'}}}} "
                          "naming one of tools.")


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


def finish_document(schema: dict[str, Any]) -> dict[str, Any]:
    """The generated document with the request models' schemas in ``components`` and FastAPI's 422 gone: a
    body or parameter the gateway refuses is a 400 with the OpenAI error body (listed on each route)."""
    components = schema.setdefault("components", {}).setdefault("schemas", {})
    components.update(component_schemas())
    for operations in schema.get("paths", {}).values():
        for operation in operations.values():
            operation.get("responses", {}).pop("422", None)
    for name in ("HTTPValidationError", "ValidationError"):
        components.pop(name, None)
    return schema


HEALTH_ROUTE: dict[str, Any] = {"responses": {
    200: {"model": Health, "description": "A request can be served."},
    503: {"model": Health, "description": "No request can be served now (the body says why)."}}}
MODEL_ROUTES: dict[str, Any] = {"responses": {200: {"model": ModelList}, **_errors(401)}}
MODEL_ROUTE: dict[str, Any] = {"responses": {200: {"model": ModelCard}, **_errors(401, 404)}}
METRICS_ROUTE: dict[str, Any] = {"responses": {200: {
    "description": "Prometheus text exposition.", "content": {"text/plain": {"schema": {"type": "string"}}}}}}
