"""The served /openapi.json describes the API the gateway implements: request bodies with the bounds the
validator enforces, the answers as JSON and as SSE, the OpenAI error body on every status it answers with,
/metrics as text, and every reference resolving."""

from __future__ import annotations

from typing import Any

import orjson
import pydantic
import pytest

from services.gateway.app import create_app
from services.gateway.config import GatewaySettings
from services.gateway.errors import APIError
from services.gateway.openapi import ChatCompletionRequest, CompletionRequest
from services.gateway.service import GatewayService
from services.gateway.validation import parse_request
from shared.tokens import EstimatingCounter


@pytest.fixture(scope="module")
def doc() -> dict[str, Any]:
    return create_app(GatewayService(GatewaySettings())).api.openapi()


def refs(node: Any) -> list[str]:
    if isinstance(node, dict):
        return [v for k, v in node.items() if k == "$ref"] + [r for v in node.values() for r in refs(v)]
    return [r for v in node for r in refs(v)] if isinstance(node, list) else []


def test_every_inference_route_has_its_body_answers_and_errors(doc: dict[str, Any]) -> None:
    for path, required in (("/v1/completions", "prompt"), ("/v1/chat/completions", "messages")):
        op = doc["paths"][path]["post"]
        body = op["requestBody"]["content"]["application/json"]["schema"]
        assert op["requestBody"]["required"] and {"model", required} <= set(body["required"])
        assert body["additionalProperties"] is True  # the engines' own fields pass through
        responses = op["responses"]
        assert set(responses["200"]["content"]) == {"application/json", "text/event-stream"}
        for status in ("400", "401", "404", "413", "415", "429", "503"):
            assert responses[status]["content"]["application/json"]["schema"] == {
                "$ref": "#/components/schemas/ErrorResponse"}, status
        assert "422" not in responses
    assert set(doc["paths"]["/metrics"]["get"]["responses"]["200"]["content"]) == {"text/plain"}
    assert "404" in doc["paths"]["/v1/models/{model}"]["get"]["responses"]


def test_every_reference_resolves(doc: dict[str, Any]) -> None:
    schemas = doc["components"]["schemas"]
    found = refs(doc)
    assert found
    for ref in found:
        assert ref.startswith("#/components/schemas/") and ref.rsplit("/", 1)[1] in schemas, ref


@pytest.mark.parametrize(("endpoint", "body"), [
    ("completions", {"model": "m", "prompt": "hi"}),
    ("completions", {"model": "m", "prompt": [1, 2, 3], "max_tokens": 4, "logprobs": 2, "extra_engine_field": 1}),
    ("completions", {"model": "m", "prompt": "hi", "temperature": 3}),
    ("completions", {"model": "m", "prompt": "hi", "max_tokens": 0}),
    ("completions", {"model": "m", "prompt": "hi", "logprobs": 6}),
    ("completions", {"model": "", "prompt": "hi"}),
    ("chat", {"model": "m", "messages": [{"role": "user", "content": "hi"}], "top_p": 0.5}),
    ("chat", {"model": "m", "messages": []}),
    ("chat", {"model": "m", "messages": [{"role": "robot", "content": "hi"}]}),
    ("chat", {"model": "m", "messages": [{"role": "user", "content": "hi"}], "top_logprobs": 21, "logprobs": True}),
    ("chat", {"model": "m", "messages": [{"role": "user", "content": "hi"}], "n": 2}),
])
def test_the_documented_bounds_are_the_validators(endpoint: str, body: dict[str, Any]) -> None:
    try:
        parse_request(orjson.dumps(body), endpoint, counter=EstimatingCounter(), default_max_tokens=256,  # type: ignore[arg-type]
                      max_tokens_limit=4096)
        accepted = True
    except APIError:
        accepted = False
    model = CompletionRequest if endpoint == "completions" else ChatCompletionRequest
    try:
        model.model_validate(body)
        documented = True
    except pydantic.ValidationError:
        documented = False
    assert accepted == documented, body
