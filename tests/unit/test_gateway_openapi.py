"""The served /openapi.json describes the API the gateway implements: request bodies with the bounds the
validator enforces, the answers as JSON and as SSE, the OpenAI error body on every status it answers with,
/metrics as text, and every reference resolving."""

from __future__ import annotations

from typing import Any

import jsonschema
import orjson
import pytest

from services.gateway.app import create_app
from services.gateway.config import GatewaySettings
from services.gateway.errors import APIError
from services.gateway.service import GatewayService
from services.gateway.validation import parse_request
from shared.tokens import EstimatingCounter

SERVICE = GatewayService(GatewaySettings(max_tokens_limit=4096, slo_class=["interactive=0.5:0.05"]))
SERVED = create_app(SERVICE).api.openapi()


@pytest.fixture(scope="module")
def doc() -> dict[str, Any]:
    return create_app(GatewayService(GatewaySettings())).api.openapi()


def body_validator(document: dict[str, Any], path: str) -> jsonschema.Draft202012Validator:
    """A JSON Schema validator of ``path``'s request body, its references resolving in ``document``."""
    body = document["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"]
    return jsonschema.Draft202012Validator({**body, "components": document["components"]})


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
    # what schemathesis found the schema allowing and the validator refusing
    ("completions", {"model": "m", "prompt": ""}),
    ("chat", {"model": "m", "messages": [{"role": "tool", "content": None}]}),
    # and their neighbours
    ("completions", {"model": "m", "prompt": []}),
    ("completions", {"model": "m", "prompt": [3, -1]}),
    ("completions", {"model": "m", "prompt": ["one prompt"]}),
    ("completions", {"model": "m", "prompt": ["two", "prompts"]}),
    ("chat", {"model": "m", "messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": None}]}),
    ("chat", {"model": "m", "messages": [{"role": "assistant"}]}),
    ("chat", {"model": "m", "messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}]}),
    ("chat", {"model": "m", "messages": [{"role": "user", "content": [{"type": "image_url"}]}]}),
    ("chat", {"model": "m", "messages": [{"role": "user"}]}),
    ("completions", {"model": "m", "prompt": "hi", "response_format": {}}),
    ("completions", {"model": "m", "prompt": "hi", "response_format": {"type": "json_object"}}),
    ("completions", {"model": "m", "prompt": "hi", "response_format": {"type": "json_schema"}}),
    ("completions", {"model": "m", "prompt": "hi", "response_format": {"type": "json_schema",
                                                                        "json_schema": {"name": "x", "schema": {}}}}),
    ("completions", {"model": "m", "prompt": "hi", "stop": ""}),
    ("completions", {"model": "m", "prompt": "hi", "stop": ["a", "b", "c", "d", "e"]}),
    ("completions", {"model": "m", "prompt": "hi", "stop": ["a", "b"]}),
    ("completions", {"model": "m", "prompt": "hi", "slo": {"ttft_s": 0}}),
    ("completions", {"model": "m", "prompt": "hi", "slo": {"ttft_s": 1.5, "name": "batch"}}),
    ("completions", {"model": "m", "prompt": "hi", "slo": {"deadline": 3}}),
    ("completions", {"model": "m", "prompt": "hi", "slo": {"name": "no spaces"}}),
    ("chat", {"model": "m", "messages": [{"role": "user", "content": "hi"}], "tools": [{"function": {}}]}),
    ("chat", {"model": "m", "messages": [{"role": "user", "content": "hi"}],
              "tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": "required"}),
    ("chat", {"model": "m", "messages": [{"role": "user", "content": "hi"}],
              "tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": "sometimes"}),
    ("chat", {"model": "m", "messages": [{"role": "user", "content": "hi"}],
              "tools": [{"type": "function", "function": {"name": "f"}}],
              "tool_choice": {"type": "function", "function": {"name": "f"}}}),
    # this deployment's bounds
    ("completions", {"model": "m", "prompt": "hi", "max_tokens": 4096}),
    ("completions", {"model": "m", "prompt": "hi", "max_tokens": 4097}),
    ("chat", {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 5000}),
    ("completions", {"model": "m", "prompt": "hi", "slo": {"ttft_s": 1e-9}}),
    ("completions", {"model": "m", "prompt": "hi", "slo_class": "interactive"}),
    ("completions", {"model": "m", "prompt": "hi", "slo_class": "batch"}),
    # the rules across fields
    ("completions", {"model": "m", "prompt": "hi", "stream_options": {"include_usage": True}}),
    ("completions", {"model": "m", "prompt": "hi", "stream": True, "stream_options": {"include_usage": True}}),
    ("chat", {"model": "m", "messages": [{"role": "user", "content": "hi"}], "top_logprobs": 2}),
    ("chat", {"model": "m", "messages": [{"role": "user", "content": "hi"}], "top_logprobs": 0}),
    ("chat", {"model": "m", "messages": [{"role": "user", "content": "hi"}], "tool_choice": "auto"}),
    ("chat", {"model": "m", "messages": [{"role": "user", "content": "hi"}], "tool_choice": "none"}),
    ("chat", {"model": "m", "messages": [{"role": "user", "content": "hi"}], "tools": [],
              "tool_choice": {"function": {"name": "f"}}}),
    # JSON Schema's integers include whole-number floats
    ("chat", {"model": "m", "messages": [{"role": "user", "content": "hi"}], "logprobs": True, "top_logprobs": 15.0}),
    ("completions", {"model": "m", "prompt": [1.0, 2.0], "n": 1.0, "seed": 3.0, "logprobs": 2.0, "max_tokens": 8.0}),
    ("completions", {"model": "m", "prompt": [1.5]}),
    ("completions", {"model": "m", "prompt": "hi", "priority": 2.5}),
    # integers JSON carries exactly (up to 2**53 - 1)
    ("completions", {"model": "m", "prompt": [10627.0, 1e19]}),
    ("completions", {"model": "m", "prompt": [2**53 - 1]}),
    ("completions", {"model": "m", "prompt": [2**53]}),
    ("completions", {"model": "m", "prompt": [2**63 + 190]}),
    ("completions", {"model": "m", "prompt": "hi", "seed": 2**63}),
    ("completions", {"model": "m", "prompt": "hi", "seed": -(2**53) + 1}),
    ("completions", {"model": "m", "prompt": "hi", "priority": 2**53}),
])
def test_the_documented_bounds_are_the_validators(endpoint: str, body: dict[str, Any]) -> None:
    """A body the served document allows is one the gateway accepts, and the other way round (schemathesis'
    positive and negative checks, on these bodies): the document is read as a JSON Schema 2020-12 validator
    reads it, with this deployment's bounds and the conditions across fields."""
    try:
        parse_request(orjson.dumps(body), endpoint, counter=EstimatingCounter(), default_max_tokens=256,  # type: ignore[arg-type]
                      max_tokens_limit=SERVICE.settings.max_tokens_limit, slo_table=SERVICE.slo_table)
        accepted = True
    except APIError:
        accepted = False
    path = "/v1/completions" if endpoint == "completions" else "/v1/chat/completions"
    assert accepted == body_validator(SERVED, path).is_valid(body), body


def test_the_served_document_states_this_deployments_bounds() -> None:
    """max_tokens' limit, the smallest slo.ttft_s and the SLO class names come from the gateway's settings, so
    a request the document allows is one this deployment accepts."""
    settings = GatewaySettings(max_tokens_limit=1234, slo_class=["interactive=0.5:0.05", "batch=30:1"])
    service = GatewayService(settings)
    served = create_app(service).api.openapi()
    for path in ("/v1/completions", "/v1/chat/completions"):
        props = served["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"]["properties"]
        assert [b.get("maximum") for b in props["max_tokens"]["anyOf"]] == [1234, None]
        assert props["slo_class"]["anyOf"][0]["enum"] == ["batch", "interactive"]
    ttft = served["components"]["schemas"]["SloTargets"]["properties"]["ttft_s"]["anyOf"][0]
    assert ttft["minimum"] == service.slo_table.min_ttft_s > 0
    assert served["paths"]["/v1/chat/completions"]["post"]["requestBody"]["content"]["application/json"][
        "schema"]["properties"]["max_completion_tokens"]["anyOf"][0]["maximum"] == 1234


def test_without_slo_classes_the_document_allows_no_class_name(doc: dict[str, Any]) -> None:
    props = doc["paths"]["/v1/completions"]["post"]["requestBody"]["content"]["application/json"]["schema"]["properties"]
    assert props["slo_class"]["anyOf"] == [{"type": "null"}]


def test_whole_number_floats_reach_the_engines_as_integers() -> None:
    parsed = parse_request(orjson.dumps({"model": "m", "prompt": [1.0, 2], "n": 1.0, "seed": 3.0, "priority": 2.0,
                                         "logprobs": 2.0, "max_tokens": 8.0}), "completions",
                           counter=EstimatingCounter(), default_max_tokens=256, max_tokens_limit=4096)
    body = parsed.body
    assert (body["prompt"], body["n"], body["seed"], body["priority"], body["logprobs"], body["max_tokens"]) == (
        [1, 2], 1, 3, 2, 2, 8)
    assert all(type(v) is int for v in (*body["prompt"], body["n"], body["seed"], body["logprobs"], body["max_tokens"]))
    assert parsed.priority == 2 and type(parsed.priority) is int
