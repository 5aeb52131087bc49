"""engine_sim's generation routes against SGLang 0.5.23: /v1/completions and /v1/chat/completions (responses,
SSE framing, chunk shapes, ``stream_options`` include_usage / continuous_usage_stats), their error shapes and
status codes, /generate, and one request exactly as Poise's gateway sends it to a prefill/decode pair."""

from __future__ import annotations

import json
import random
import threading
from typing import Any

import httpx
import pytest

from tests.contract.conftest import Engines
from tests.contract.extensions import EXTENSIONS
from tests.contract.shapes import assert_shape, fixture

COMPLETIONS = fixture("openai_completions")
CHAT = fixture("openai_chat_completions")
ERRORS = fixture("errors")
N = 12  # output tokens per request (ignore_eos: exactly this many)


def _events(response: httpx.Response) -> list[str]:
    """The SSE payloads, after checking SGLang's framing: only ``data: <payload>\\n\\n`` events, [DONE] last."""
    assert response.headers["content-type"].startswith("text/event-stream")
    text = response.text
    assert text.endswith("\n\n")
    raw = text[:-2].split("\n\n")
    for event in raw:
        assert event.startswith("data: ") and "\n" not in event, f"not an SSE data event: {event!r}"
    payloads = [e[len("data: "):] for e in raw]
    assert payloads[-1] == "[DONE]" and "[DONE]" not in payloads[:-1]
    return payloads[:-1]


def _chunks(response: httpx.Response) -> list[dict[str, Any]]:
    return [json.loads(p) for p in _events(response)]


def _completion(client: httpx.Client, engines: Engines, **body: Any) -> httpx.Response:
    return client.post(engines.null.url + "/v1/completions",
                       json={"prompt": "Say something", "max_tokens": N, "ignore_eos": True, **body})


def _chat(client: httpx.Client, engines: Engines, **body: Any) -> httpx.Response:
    return client.post(engines.null.url + "/v1/chat/completions",
                       json={"messages": [{"role": "user", "content": "Say something"}], "max_tokens": N,
                             "ignore_eos": True, **body})


def test_completion_response(engines: Engines, client: httpx.Client) -> None:
    r = _completion(client, engines, model="my-model")
    assert r.status_code == 200 and r.headers["content-type"] == COMPLETIONS["response"]["content_type"]
    body = r.json()
    assert_shape(body, COMPLETIONS["response"]["shape"], "openai_completions")
    assert body["model"] == "my-model"  # the request's model, as SGLang echoes it
    assert body["usage"]["completion_tokens"] == N and body["choices"][0]["finish_reason"] == "length"
    assert body["usage"]["total_tokens"] == body["usage"]["prompt_tokens"] + N


@pytest.mark.parametrize("options", [None, {}, {"include_usage": True}, {"continuous_usage_stats": True},
                                     {"include_usage": True, "continuous_usage_stats": True}],
                         ids=["no-options", "empty", "include_usage", "continuous", "both"])
def test_completion_stream(engines: Engines, client: httpx.Client, options: dict[str, Any] | None) -> None:
    r = _completion(client, engines, stream=True, **({"stream_options": options} if options is not None else {}))
    assert r.status_code == 200
    chunks = _chunks(r)
    include_usage = bool(options and options.get("include_usage"))
    continuous = bool(options and options.get("continuous_usage_stats"))
    body_chunks = chunks[:-1] if include_usage else chunks
    assert len(body_chunks) >= 2, "expected several events"
    seen = 0
    for chunk in body_chunks:
        assert_shape(chunk, COMPLETIONS["stream"]["chunk"], "openai_completions", extensions=EXTENSIONS)
        assert "usage" in chunk  # model_dump_json keeps None
        if continuous:  # usage on every chunk, cumulative (what the gateway resumes from)
            usage = chunk["usage"]
            assert usage is not None and set(usage) == set(COMPLETIONS["definitions"]["UsageInfo"]["fields"])
            assert usage["completion_tokens"] > seen and usage["total_tokens"] == usage["prompt_tokens"] + \
                usage["completion_tokens"]
            seen = usage["completion_tokens"]
        else:
            assert chunk["usage"] is None
    assert body_chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert all(c["choices"][0]["finish_reason"] is None for c in body_chunks[:-1])
    if continuous:
        assert seen == N
    if include_usage:
        final = chunks[-1]
        assert_shape(final, COMPLETIONS["stream"]["final_usage_chunk"]["shape"], "openai_completions")
        assert final["usage"]["completion_tokens"] == N and "prompt_tokens_details" not in final["usage"]


@pytest.mark.parametrize("options", [None, {"include_usage": True}, {"continuous_usage_stats": True},
                                     {"include_usage": True, "continuous_usage_stats": True}],
                         ids=["no-options", "include_usage", "continuous", "both"])
def test_chat_stream(engines: Engines, client: httpx.Client, options: dict[str, Any] | None) -> None:
    r = _chat(client, engines, stream=True, **({"stream_options": options} if options is not None else {}))
    assert r.status_code == 200
    chunks = _chunks(r)
    include_usage = bool(options and options.get("include_usage"))
    continuous = bool(options and options.get("continuous_usage_stats"))
    if include_usage:
        usage_chunk = chunks.pop()
        assert_shape(usage_chunk, CHAT["stream"]["usage_chunk"], "openai_chat_completions")
        assert usage_chunk["usage"]["completion_tokens"] == N
        assert set(usage_chunk["usage"]) == set(CHAT["definitions"]["UsageInfo"]["fields"])  # None kept
    for chunk in chunks:
        assert_shape(chunk, CHAT["stream"]["chunk"], "openai_chat_completions", extensions=EXTENSIONS)
    role, *content, finish = chunks
    assert role["choices"][0]["delta"] == {"reasoning_content": None, "role": "assistant", "content": ""}
    assert "usage" not in role and role["choices"][0]["finish_reason"] is None
    assert finish["choices"][0]["delta"] == {"reasoning_content": None} and "usage" not in finish
    assert finish["choices"][0]["finish_reason"] == "length"
    assert len(content) >= 2
    seen = 0
    for chunk in content:
        delta = chunk["choices"][0]["delta"]
        assert set(delta) == {"reasoning_content", "content"} and delta["content"]
        assert chunk["choices"][0]["finish_reason"] is None
        if continuous:
            assert set(chunk["usage"]) == set(CHAT["definitions"]["UsageInfo"]["fields"])
            assert chunk["usage"]["completion_tokens"] > seen
            seen = chunk["usage"]["completion_tokens"]
        else:
            assert "usage" not in chunk  # StreamChunk omits a None usage
    if continuous:
        assert seen == N


def test_chat_response(engines: Engines, client: httpx.Client) -> None:
    r = _chat(client, engines)
    assert r.status_code == 200
    body = r.json()
    assert_shape(body, CHAT["response"]["shape"], "openai_chat_completions")
    assert body["model"] == "default" and body["choices"][0]["message"]["role"] == "assistant"
    assert body["usage"]["completion_tokens"] == N


def test_error_shapes(engines: Engines, client: httpx.Client) -> None:
    cases = ERRORS["cases"]
    url = engines.null.url + "/v1/completions"
    malformed = [
        client.post(url, content=b'{"prompt": "x"}', headers={"content-type": "text/plain"}),  # not JSON content
        client.post(url, content=b'{"prompt": ', headers={"content-type": "application/json"}),
        client.post(url, json={"max_tokens": 4}),  # prompt missing
        client.post(url, json={"prompt": "x", "max_tokens": 0}),  # CompletionRequest's validator
    ]
    expected = cases["malformed body (RequestValidationError, incl. Content-Type not application/json on OpenAI routes)"]
    for r in malformed:
        assert r.status_code == expected["status"], r.text
        assert_shape(r.json(), expected["shape"], "errors")
        assert (r.json()["type"], r.json()["code"]) == (expected["type"], expected["code"])
    refused = client.post(url, json={"prompt": ""})
    expected = cases["OpenAI request refused by _validate_request (e.g. 'Prompt cannot be empty')"]
    assert refused.status_code == expected["status"]
    assert_shape(refused.json(), expected["shape"], "errors")
    assert (refused.json()["type"], refused.json()["message"]) == (expected["type"], "Prompt cannot be empty")
    native = client.post(engines.null.url + "/generate", json={"sampling_params": {"max_new_tokens": 2}})
    assert native.status_code == 400
    assert_shape(native.json(), cases["native route ValueError (/generate non-streaming, /abort_request, "
                                      "/pd_role_switch raising)"]["shape"], "errors")


def test_scheduler_abort_with_status(engines: Engines, client: httpx.Client) -> None:
    """A PD decode request without a bootstrap room: the scheduler aborts it with status 400."""
    cases = ERRORS["cases"]
    url = engines.decode.url + "/v1/completions"
    r = client.post(url, json={"prompt": "x", "max_tokens": 2})
    expected = cases["OpenAI non-streaming request the scheduler aborts with status 400"]
    assert r.status_code == expected["status"]
    assert_shape(r.json(), expected["shape"], "errors")
    assert r.json()["type"] == expected["type"]
    for include_usage in (False, True):
        r = client.post(url, json={"prompt": "x", "max_tokens": 2, "stream": True,
                                   "stream_options": {"include_usage": include_usage}})
        assert r.status_code == 200  # headers went out with the first event
        payloads = _events(r)
        error = json.loads(payloads[0])
        assert_shape(error, {"ref": "StreamError"}, "errors")
        assert (error["error"]["type"], error["error"]["code"]) == ("BAD_REQUEST", 400)
        assert payloads[0] == json.dumps(error)  # create_streaming_error_response uses json.dumps
        if include_usage:  # the usage chunk still follows the error event, then [DONE]
            assert len(payloads) == 2
            assert_shape(json.loads(payloads[1]), COMPLETIONS["stream"]["final_usage_chunk"]["shape"],
                         "openai_completions")
        else:
            assert len(payloads) == 1


def test_generate(engines: Engines, client: httpx.Client) -> None:
    spec = fixture("generate")
    r = client.post(engines.null.url + "/generate", json={"text": "hello", "sampling_params": {
        "max_new_tokens": N, "ignore_eos": True}})
    assert r.status_code == 200
    body = r.json()
    assert_shape(body, spec["response"]["shape"], "generate")
    assert len(body["output_ids"]) == N and body["meta_info"]["finish_reason"] == {"type": "length", "length": N}
    assert "e2e_latency" in body["meta_info"]
    r = client.post(engines.null.url + "/generate", json={"input_ids": [1, 2, 3], "stream": True,
                                                          "sampling_params": {"max_new_tokens": N, "ignore_eos": True}})
    outputs = _chunks(r)
    for out in outputs:
        assert_shape(out, spec["response"]["shape"], "generate")
    counts = [len(o["output_ids"]) for o in outputs]
    assert counts == sorted(counts) and counts[-1] == N  # cumulative
    assert all(o["meta_info"]["finish_reason"] is None for o in outputs[:-1])
    assert outputs[-1]["meta_info"]["finish_reason"]["type"] == "length"


def test_a_request_as_poises_gateway_sends_it(engines: Engines, client: httpx.Client) -> None:
    """services/gateway/legs.py Attempt.bodies: the same body with rid and bootstrap_* to both engines; the
    prefill leg not streaming, the decode leg streaming with include_usage and continuous_usage_stats."""
    room = random.getrandbits(63)
    base = {"model": "m", "prompt": "Tell me a story", "max_tokens": N, "ignore_eos": True, "rid": f"gw-{room}",
            "bootstrap_host": "127.0.0.1", "bootstrap_port": engines.prefill.bootstrap_port, "bootstrap_room": room}
    prefill: dict[str, Any] = {}

    def prefill_leg() -> None:
        with httpx.Client(timeout=30.0, trust_env=False) as c:
            prefill["r"] = c.post(engines.prefill.url + "/v1/completions", json={**base, "stream": False})

    leg = threading.Thread(target=prefill_leg, daemon=True)
    leg.start()
    decode = client.post(engines.decode.url + "/v1/completions", json={
        **base, "stream": True, "stream_options": {"include_usage": True, "continuous_usage_stats": True}})
    leg.join(30)
    assert decode.status_code == 200
    chunks = _chunks(decode)
    for chunk in chunks[:-1]:
        assert_shape(chunk, COMPLETIONS["stream"]["chunk"], "openai_completions", extensions=EXTENSIONS)
        assert chunk["id"] == base["rid"] and chunk["usage"]["completion_tokens"] >= 1
    assert_shape(chunks[-1], COMPLETIONS["stream"]["final_usage_chunk"]["shape"], "openai_completions")
    assert chunks[-1]["usage"]["completion_tokens"] == N
    assert prefill["r"].status_code == 200
    assert_shape(prefill["r"].json(), COMPLETIONS["response"]["shape"], "openai_completions")
