"""The gateway's input limits and validation against real engine_sim processes: nothing a client sends gets a
5xx, oversized, slow or mistyped bodies are refused with their own status, and an engine's 4xx is final.
"""

from __future__ import annotations

import asyncio
import random
import socket
import time
from typing import Any

import httpx
import msgspec
import orjson
import pytest

from tests.integration.gateway_harness import counted, register
from tests.integration.test_gateway_failures import BODY, MODEL, cluster, engines, gateway, wait_instances

__all__ = ["cluster", "engines"]  # the fixtures, shared with the failure tests
pytestmark = pytest.mark.asyncio

JSON = {"content-type": "application/json"}


async def test_content_type_size_and_depth_limits(cluster, engines, nats_server, etcd_server) -> None:  # type: ignore[no-untyped-def]
    registry, ns = cluster
    await register(registry, engines["prefill"].info("p0"), engines["decode"].info("d0"))
    async with gateway(nats_server, etcd_server, ns, max_body_bytes=64 * 1024, max_json_depth=16) as (url, service):
        await wait_instances(service, 2)
        raw = orjson.dumps(BODY)
        async with httpx.AsyncClient(timeout=30) as client:
            for headers in ({}, {"content-type": "text/plain"}, {"content-type": "application/x-www-form-urlencoded"}):
                r = await client.post(url + "/v1/completions", content=raw, headers=headers)
                assert r.status_code == 415 and r.json()["error"]["code"] == "unsupported_media_type", r.text
            r = await client.post(url + "/v1/completions", content=raw,
                                  headers={"content-type": "Application/JSON; charset=utf-8"})
            assert r.status_code == 200, r.text

            big = orjson.dumps({**BODY, "prompt": list(range(20_000))})  # ~110 KB
            r = await client.post(url + "/v1/completions", content=big, headers=JSON)
            assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large", r.text

            async def chunked() -> Any:  # no Content-Length: the cap holds while reading
                for k in range(0, len(big), 8192):
                    yield big[k:k + 8192]

            r = await client.post(url + "/v1/completions", content=chunked(), headers=JSON)
            assert r.status_code == 413, r.text

            nested: Any = "x"
            for _ in range(300):  # past orjson's encoder limit (254) when forwarded
                nested = {"a": nested}
            r = await client.post(url + "/v1/completions", json={**BODY, "extra": nested})
            assert r.status_code == 400 and "nests" in r.json()["error"]["message"], r.text
            r = await client.post(url + "/v1/completions", json={**BODY, "extra": [[[1]]]})
            assert r.status_code == 200, r.text


async def test_a_trickled_body_gets_408(cluster, engines, nats_server, etcd_server) -> None:  # type: ignore[no-untyped-def]
    registry, ns = cluster
    async with gateway(nats_server, etcd_server, ns, body_timeout_s=0.5) as (url, service):
        host, port = url.removeprefix("http://").split(":")
        reader, writer = await asyncio.open_connection(host, int(port))
        raw = orjson.dumps(BODY)
        writer.write(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                     b"content-length: %d\r\n\r\n" % len(raw) + raw[:10])
        await writer.drain()
        t0 = time.monotonic()
        async with asyncio.timeout(10):
            head = await reader.readuntil(b"\r\n\r\n")
            rest = await reader.read()  # the gateway closes the connection after the 408
        assert head.startswith(b"HTTP/1.1 408"), head
        assert b"request_timeout" in rest and time.monotonic() - t0 < 5
        writer.close()


async def test_engine_4xx_is_final_not_retried(cluster, engines, nats_server, etcd_server) -> None:  # type: ignore[no-untyped-def]
    registry, ns = cluster
    # Two decode registrations: a retry would have somewhere to go.
    await register(registry, engines["prefill"].info("p0"), engines["decode"].info("d0"), engines["decode"].info("d1"))
    async with gateway(nats_server, etcd_server, ns) as (url, service):
        await wait_instances(service, 3)
        async with httpx.AsyncClient(timeout=30) as client:
            r = await client.post(url + "/v1/completions", json={**BODY, "prompt": list(range(140_000))})
        assert r.status_code == 400 and "context length" in r.json()["error"]["message"], r.text
        assert counted(service, "poise_gateway_retries_total") == 0


def _junk(rng: random.Random, depth: int = 0) -> Any:
    kinds = ["int", "neg", "float", "str", "bool", "null", "list", "dict", "big"] if depth < 3 else ["int", "str", "null"]
    kind = rng.choice(kinds)
    if kind == "list":
        return [_junk(rng, depth + 1) for _ in range(rng.randint(0, 3))]
    if kind == "dict":
        return {rng.choice(["type", "text", "role", "x", "include_usage"]): _junk(rng, depth + 1)
                for _ in range(rng.randint(0, 3))}
    return {"int": rng.randint(0, 5), "neg": -rng.randint(1, 10**6), "float": rng.random() * 3, "str": rng.choice(["", "x", "user"]),
            "bool": rng.random() < 0.5, "null": None, "big": 10**20}[kind]


FIELDS = ["model", "prompt", "messages", "max_tokens", "max_completion_tokens", "temperature", "top_p", "top_k",
          "stream", "stream_options", "stop", "n", "ignore_eos", "echo", "logprobs", "priority", "slo", "slo_class",
          "seed", "min_tokens", "stop_token_ids", "regex", "json_schema", "response_format", "logit_bias", "tools",
          "user", "presence_penalty", "frequency_penalty", "rid", "bootstrap_room", "lora_path", "return_logprob"]


async def test_fuzzed_bodies_never_get_a_5xx(cluster, engines, nats_server, etcd_server) -> None:  # type: ignore[no-untyped-def]
    registry, ns = cluster
    await register(registry, engines["prefill"].info("p0"), engines["decode"].info("d0"))
    rng = random.Random(7)
    bodies: list[tuple[str, dict[str, Any]]] = [
        ("chat", {"model": MODEL, "messages": [{"role": {}, "content": "x"}]}),
        ("chat", {"model": MODEL, "messages": [{"role": "user", "content": [{"type": "text", "text": {}}]}]}),
        ("completions", {**BODY, "prompt": [[]]}),
        ("completions", {**BODY, "prompt": [True, 1]}),
    ]
    for _ in range(240):
        chat = rng.random() < 0.5
        body: dict[str, Any] = {"model": MODEL, "max_tokens": 2}
        body.update({"messages": [{"role": "user", "content": "hi"}]} if chat else {"prompt": "hello"})
        for name in rng.sample(FIELDS, rng.randint(1, 3)):
            body[name] = _junk(rng)
        if rng.random() < 0.3 and chat:
            body["messages"] = [{"role": _junk(rng), "content": _junk(rng)}]
        bodies.append(("chat" if chat else "completions", body))
    async with gateway(nats_server, etcd_server, ns) as (url, service):
        await wait_instances(service, 2)
        async with httpx.AsyncClient(timeout=60) as client:
            sem = asyncio.Semaphore(16)

            async def send(route: str, body: dict[str, Any]) -> tuple[int, str]:
                path = "/v1/chat/completions" if route == "chat" else "/v1/completions"
                async with sem:
                    r = await client.post(url + path, json=body)
                return r.status_code, r.text

            results = await asyncio.gather(*(send(route, body) for route, body in bodies))
            five = [(status, text, body) for (status, text), (_, body) in zip(results, bodies, strict=True) if status >= 500]
            assert not five, five[:5]
            assert sum(status == 400 for status, _ in results) > 50  # the fuzz does reach the validator
            for status, text in results:
                assert "error" in orjson.loads(text) if status >= 400 else True
            r = await client.post(url + "/v1/completions", json=BODY)  # the gateway still serves
            assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 16


async def test_the_openai_contract_details_clients_rely_on(cluster, engines, nats_server, etcd_server) -> None:  # type: ignore[no-untyped-def]
    """``client.models.retrieve()``, a request id on every answer, a 405 that says what is allowed (RFC 9110)."""
    registry, ns = cluster
    await register(registry, engines["prefill"].info("p0"), engines["decode"].info("d0"))
    async with gateway(nats_server, etcd_server, ns) as (url, service), httpx.AsyncClient(timeout=30) as client:
        await wait_instances(service, 2)
        r = await client.get(url + f"/v1/models/{MODEL}")
        assert r.status_code == 200 and r.json()["id"] == MODEL and r.json()["object"] == "model", r.text
        r = await client.get(url + "/v1/models/not-served")
        assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found", r.text
        r = await client.post(url + "/v1/completions", json={**BODY, "stream": False})
        assert r.status_code == 200 and r.headers["x-request-id"] == r.json()["id"], r.headers
        r = await client.get(url + "/v1/completions")
        assert r.status_code == 405 and r.headers["allow"] == "POST" and r.json()["error"]["message"], r.text


async def test_a_chat_request_without_max_tokens_runs_to_its_end(cluster, engines, nats_server, etcd_server) -> None:  # type: ignore[no-untyped-def]
    """As OpenAI and SGLang: no limit is sent, so the answer ends where the model stops (engine_sim's drawn
    stop length), past the gateway's planning default of 8 here; a completion without one gets 16 tokens."""
    registry, ns = cluster
    await register(registry, engines["prefill"].info("p0"), engines["decode"].info("d0"))
    async with gateway(nats_server, etcd_server, ns, default_max_tokens=8) as (url, service), \
            httpx.AsyncClient(timeout=60) as client:
        await wait_instances(service, 2)
        lengths = []
        for i in range(4):
            r = await client.post(url + "/v1/chat/completions", json={
                "model": MODEL, "messages": [{"role": "user", "content": f"question {i}"}]})
            assert r.status_code == 200, r.text
            assert r.json()["choices"][0]["finish_reason"] == "stop", r.text
            lengths.append(r.json()["usage"]["completion_tokens"])
        assert max(lengths) > 8, lengths
        r = await client.post(url + "/v1/completions", json={"model": MODEL, "prompt": list(range(50)), "ignore_eos": True})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 16, r.text


async def test_a_client_that_sends_the_whole_oversized_body_first_reads_the_413(cluster, engines, nats_server,  # type: ignore[no-untyped-def]
                                                                                   etcd_server) -> None:
    """As Python's urllib does: the whole body is written before the response is read. A body up to
    DISCARD_FACTOR x the limit (15 MiB on a 2 MiB limit, more than the loopback's socket buffers hold) is read and
    dropped, so the client gets to read the 413 instead of a reset."""
    registry, ns = cluster
    await register(registry, engines["prefill"].info("p0"), engines["decode"].info("d0"))
    async with gateway(nats_server, etcd_server, ns, max_body_bytes=2 * 1024 * 1024) as (url, service):
        await wait_instances(service, 2)
        host, port = url.removeprefix("http://").split(":")
        body = b'{"model": "' + MODEL.encode() + b'", "prompt": "' + b"x" * (15 * 1024 * 1024) + b'"}'
        head = (f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
                f"Content-Length: {len(body)}\r\n\r\n").encode()

        def send_all_then_read() -> bytes:
            with socket.create_connection((host, int(port)), timeout=30) as s:
                s.sendall(head + body)  # a reset here is the bug
                answer = b""
                while chunk := s.recv(65536):
                    answer += chunk
                return answer

        answer = await asyncio.to_thread(send_all_then_read)
        assert answer.startswith(b"HTTP/1.1 413"), answer[:200]
        assert b"request_too_large" in answer


async def test_the_ttft_metric_counts_from_the_request_not_from_its_parsed_body(cluster, engines, nats_server,  # type: ignore[no-untyped-def]
                                                                                etcd_server) -> None:
    """A body that takes 0.6 s to arrive: the client waited that long for its first token too."""
    from prometheus_client.parser import text_string_to_metric_families

    registry, ns = cluster
    await register(registry, engines["prefill"].info("p0"), engines["decode"].info("d0"))
    async with gateway(nats_server, etcd_server, ns) as (url, service), httpx.AsyncClient(timeout=30) as client:
        await wait_instances(service, 2)
        raw = orjson.dumps({**BODY, "max_tokens": 2, "stream": True})  # a stream: its first token is timed

        async def slow() -> Any:
            yield raw[:10]
            await asyncio.sleep(0.6)  # paces the client's body (what is measured), not a wait for a result
            yield raw[10:]

        r = await client.post(url + "/v1/completions", content=slow(), headers=JSON)
        assert r.status_code == 200, r.text

        async def ttft() -> dict[str, float]:
            text = (await client.get(url + "/metrics")).text
            return {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples
                    if s.name.startswith("poise_gateway_ttft_seconds_")}

        deadline = time.monotonic() + 10
        while (seen := await ttft())["poise_gateway_ttft_seconds_count"] < 1:  # recorded once the flow ends
            assert time.monotonic() < deadline, seen
            await asyncio.sleep(0.05)
    assert seen["poise_gateway_ttft_seconds_count"] == 1 and seen["poise_gateway_ttft_seconds_sum"] >= 0.6, seen


async def test_a_seed_is_refused_where_an_engine_of_the_model_would_not_apply_it(  # type: ignore[no-untyped-def]
        cluster, engines, nats_server, etcd_server) -> None:
    registry, ns = cluster
    unseeded = msgspec.structs.replace(engines["decode"].info("d0"), applies_seed=False)  # SGLang, not deterministic
    await register(registry, engines["prefill"].info("p0"), unseeded)
    seeded = {**BODY, "seed": 7}
    async with gateway(nats_server, etcd_server, ns) as (url, service):
        await wait_instances(service, 2)
        async with httpx.AsyncClient(timeout=30) as client:
            r = await client.post(url + "/v1/completions", json=seeded)
            assert r.status_code == 400 and r.json()["error"]["param"] == "seed", r.text
            assert (await client.post(url + "/v1/completions", json=BODY)).status_code == 200
    async with gateway(nats_server, etcd_server, ns, accept_unapplied_seed=True) as (url, service):
        await wait_instances(service, 2)
        async with httpx.AsyncClient(timeout=30) as client:
            r = await client.post(url + "/v1/completions", json=seeded)
            assert r.status_code == 200, r.text
