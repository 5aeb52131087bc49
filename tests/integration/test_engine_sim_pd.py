"""engine_sim as real processes: a prefill and a decode engine (plus a colocated one) on free loopback ports,
driven over HTTP the way SGLang's router drives a PD pair (same body, with bootstrap_host/port/room, to both)."""

from __future__ import annotations

import asyncio
import itertools
import math
from collections.abc import AsyncIterator, Iterator
from typing import Any

import httpx
import orjson
import pytest

from tests.integration.engine_procs import Engine, start_engine, stop, wait_healthy

TIME_SCALE = "0.05"  # fast, but slow enough that a 2000-token stream is still running when we poke it
_rooms = itertools.count(1000)
JSON = "application/json"


@pytest.fixture(scope="module")
def engines(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Engine]]:
    tmp = tmp_path_factory.mktemp("engine_sim")
    started = {mode: start_engine(tmp, mode, time_scale=TIME_SCALE) for mode in ("prefill", "decode", "null")}
    try:
        wait_healthy(list(started.values()))
        yield started
    finally:
        codes = stop(list(started.values()))
    assert list(codes.values()) == [0, 0, 0], codes  # clean shutdown on SIGTERM


async def sse_events(resp: httpx.Response) -> AsyncIterator[bytes]:
    async for line in resp.aiter_lines():
        if line.startswith("data: "):
            yield line[len("data: "):].encode()


def pd_body(engines: dict[str, Engine], **extra: Any) -> dict[str, Any]:
    body = {"model": "meta-llama/Llama-3.1-8B-Instruct", "prompt": "The quick brown fox " * 50,
            "bootstrap_host": "127.0.0.1", "bootstrap_port": engines["prefill"].bootstrap_port,
            "bootstrap_room": next(_rooms)}
    body.update(extra)
    return body


@pytest.mark.asyncio
async def test_pd_stream_exact_tokens_and_usage(engines: dict[str, Engine]) -> None:
    body = pd_body(engines, max_tokens=40, ignore_eos=True, stream=True, stream_options={"include_usage": True},
                   rid="pd-exact")
    async with httpx.AsyncClient(timeout=30) as client:
        prefill_task = asyncio.create_task(client.post(engines["prefill"].url + "/v1/completions", json=body))
        texts: list[str] = []
        finish_reasons: list[str | None] = []
        usage: dict[str, Any] | None = None
        done = False
        async with client.stream("POST", engines["decode"].url + "/v1/completions", json=body) as resp:
            assert resp.status_code == 200
            assert resp.headers["content-type"].startswith("text/event-stream")
            async for data in sse_events(resp):
                if data == b"[DONE]":
                    done = True
                    continue
                chunk = orjson.loads(data)
                assert chunk["object"] == "text_completion" and chunk["id"] == "pd-exact"
                if chunk["choices"]:
                    texts.append(chunk["choices"][0]["text"])
                    finish_reasons.append(chunk["choices"][0]["finish_reason"])
                else:
                    usage = chunk["usage"]
        prefill = await prefill_task
    assert done
    assert len("".join(texts).split()) == 40  # one placeholder word per token
    assert finish_reasons[-1] == "length" and all(f is None for f in finish_reasons[:-1])
    prompt_tokens = math.ceil(len(body["prompt"]) / 4)
    assert usage == {"prompt_tokens": prompt_tokens, "completion_tokens": 40, "total_tokens": prompt_tokens + 40,
                     "reasoning_tokens": 0}
    # The prefill got the same (streaming) body: like SGLang's prefill it answers once the KV has been handed
    # over, with one chunk holding the first token (finish_reason "length"), the usage chunk, and [DONE].
    assert prefill.status_code == 200
    pevents = [line[len("data: "):] for line in prefill.text.split("\n\n") if line.startswith("data: ")]
    assert pevents[-1] == "[DONE]"
    first, pusage = orjson.loads(pevents[0]), orjson.loads(pevents[1])
    assert first["choices"][0]["finish_reason"] == "length"
    # The decode side streams the prefill's first token first (a chunk may carry several tokens when the
    # reader falls behind the engine, as SGLang coalesces).
    assert texts[0].startswith(first["choices"][0]["text"])
    assert pusage["usage"]["prompt_tokens"] == prompt_tokens and pusage["usage"]["completion_tokens"] == 1


@pytest.mark.asyncio
async def test_loads_and_metrics_have_sglang_names(engines: dict[str, Engine]) -> None:
    async with httpx.AsyncClient(timeout=10) as client:
        for mode in ("prefill", "decode"):
            url = engines[mode].url
            loads = (await client.get(url + "/v1/loads")).json()
            assert set(loads) == {"timestamp", "version", "accelerator", "num_accelerators", "loads"}
            load = loads["loads"][0]
            for key in ("num_running_reqs", "num_waiting_reqs", "num_waiting_uncached_tokens", "num_used_tokens",
                        "num_total_tokens", "max_total_num_tokens", "max_running_requests", "token_usage",
                        "gen_throughput", "cache_hit_rate", "utilization"):
                assert key in load, key
            assert load["disaggregation"]["mode"] == mode
            for key in ("prefill_bootstrap_queue_reqs", "prefill_inflight_queue_reqs", "decode_prealloc_queue_reqs",
                        "decode_transfer_queue_reqs"):
                assert key in load["disaggregation"]
            core = (await client.get(url + "/v1/loads", params={"include": "core"})).json()["loads"][0]
            assert "disaggregation" not in core and "num_used_tokens" in core
            prom = (await client.get(url + "/v1/loads", params={"format": "prometheus"})).text
            assert 'sglang_num_running_reqs{dp_rank="0"}' in prom and "sglang_disagg_decode_prealloc_queue_reqs" in prom
            bad = await client.get(url + "/v1/loads", params={"include": "nope"})
            assert bad.status_code == 400
            metrics = (await client.get(url + "/metrics")).text
            for name in ("sglang:num_running_reqs", "sglang:num_queue_reqs", "sglang:token_usage",
                         "sglang:gen_throughput", "sglang:prompt_tokens_total", "sglang:generation_tokens_total",
                         "sglang:time_to_first_token_seconds", "sglang:inter_token_latency_seconds",
                         "sglang:e2e_request_latency_seconds", "sglang:num_aborted_requests_total",
                         "sglang:kv_transfer_latency_ms", "sglang:num_prefill_bootstrap_queue_reqs",
                         "sglang:num_prefill_inflight_queue_reqs", "sglang:num_decode_prealloc_queue_reqs",
                         "sglang:num_decode_transfer_queue_reqs"):
                assert f"# TYPE {name}" in metrics, name
            assert 'engine_type="dynamic"' in metrics and 'model_name="meta-llama/Llama-3.1-8B-Instruct"' in metrics
            info = (await client.get(url + "/server_info")).json()
            assert info["engine"] == "poise-engine-sim" and info["disaggregation_mode"] == mode
            assert info["gpu_profile"]["name"] == "llama-3.1-8b-h100"
            assert info["emulated_model"] == "meta-llama/Llama-3.1-8B-Instruct"
            models = (await client.get(url + "/v1/models")).json()
            assert models["data"][0]["id"] == "meta-llama/Llama-3.1-8B-Instruct"
            assert (await client.get(url + "/model_info")).json()["disaggregation_mode"] == mode


@pytest.mark.asyncio
async def test_decode_without_bootstrap_info_errors(engines: dict[str, Engine]) -> None:
    body = {"model": "m", "prompt": "hello", "max_tokens": 4}
    async with httpx.AsyncClient(timeout=10) as client:
        resp = await client.post(engines["decode"].url + "/v1/completions", json=body)
        assert resp.status_code == 400
        err = resp.json()
        assert err["object"] == "error" and err["code"] == 400
        assert "without bootstrap room id" in err["message"]
        gen = await client.post(engines["decode"].url + "/generate", json={"text": "hello"})
        assert gen.status_code == 400 and "without bootstrap room id" in gen.json()["error"]["message"]
        # Streaming: SGLang has already answered 200 when the scheduler refuses, so the error is an SSE event.
        async with client.stream("POST", engines["decode"].url + "/v1/completions", json={**body, "stream": True}) as r:
            events = [e async for e in sse_events(r)]
        assert r.status_code == 200
        assert orjson.loads(events[0])["error"]["code"] == 400 and events[-1] == b"[DONE]"


@pytest.mark.asyncio
async def test_bad_requests_get_openai_errors(engines: dict[str, Engine]) -> None:
    url = engines["null"].url
    async with httpx.AsyncClient(timeout=10) as client:
        resp = await client.post(url + "/v1/completions", content=b"{not json", headers={"content-type": JSON})
        assert resp.status_code == 400 and resp.json()["object"] == "error"
        resp = await client.post(url + "/v1/completions", json={"prompt": "x", "max_tokens": "many"})
        assert resp.status_code == 400 and resp.json()["param"] == "max_tokens"
        resp = await client.post(url + "/v1/completions", json={"prompt": "x", "n": 2})
        assert resp.status_code == 400 and resp.json()["type"] == "BadRequestError"
        resp = await client.post(url + "/v1/chat/completions", json={"messages": []})
        assert resp.status_code == 400 and resp.json()["message"] == "Messages cannot be empty."
        resp = await client.post(url + "/v1/completions", json={"prompt": "x", "some_future_field": 1, "max_tokens": 2})
        assert resp.status_code == 200  # unknown fields are ignored



@pytest.mark.asyncio
async def test_colocated_generate_and_chat_shapes(engines: dict[str, Engine]) -> None:
    url = engines["null"].url
    async with httpx.AsyncClient(timeout=10) as client:
        gen = (await client.post(url + "/generate", json={
            "input_ids": [1, 2, 3, 4], "sampling_params": {"max_new_tokens": 6, "ignore_eos": True}})).json()
        assert len(gen["output_ids"]) == 6 and len(gen["text"].split()) == 6
        meta = gen["meta_info"]
        assert meta["prompt_tokens"] == 4 and meta["completion_tokens"] == 6
        assert meta["finish_reason"] == {"type": "length", "length": 6} and meta["e2e_latency"] > 0
        chat = (await client.post(url + "/v1/chat/completions", json={
            "model": "m", "messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 5,
            "ignore_eos": True})).json()
        assert chat["object"] == "chat.completion" and chat["usage"]["completion_tokens"] == 5
        assert chat["choices"][0]["message"]["role"] == "assistant"
        chunks = []
        async with client.stream("POST", url + "/v1/chat/completions", json={
                "model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5, "ignore_eos": True,
                "stream": True, "stream_options": {"include_usage": True}}) as resp:
            chunks = [e async for e in sse_events(resp)]
        assert chunks[-1] == b"[DONE]"
        parsed = [orjson.loads(c) for c in chunks[:-1]]
        assert parsed[0]["choices"][0]["delta"] == {"reasoning_content": None, "role": "assistant", "content": ""}
        content = "".join(p["choices"][0]["delta"].get("content") or "" for p in parsed if p["choices"])
        assert len(content.split()) == 5
        assert parsed[-2]["choices"][0]["finish_reason"] == "length"
        assert parsed[-1]["usage"]["completion_tokens"] == 5


async def _start_long_pd_stream(client: httpx.AsyncClient, engines: dict[str, Engine], rid: str
                                ) -> tuple[asyncio.Task[httpx.Response], Any, Any]:
    body = pd_body(engines, max_tokens=2000, ignore_eos=True, stream=True, rid=rid)
    prefill = asyncio.create_task(client.post(engines["prefill"].url + "/v1/completions", json=body))
    cm = client.stream("POST", engines["decode"].url + "/v1/completions", json=body)
    resp = await cm.__aenter__()
    assert resp.status_code == 200
    events = sse_events(resp)
    for _ in range(3):
        await anext(events)
    return prefill, cm, events


@pytest.mark.asyncio
async def test_role_switch_refused_when_busy_and_done_when_idle(engines: dict[str, Engine]) -> None:
    decode = engines["decode"].url
    async with httpx.AsyncClient(timeout=30) as client:
        prefill, cm, events = await _start_long_pd_stream(client, engines, "busy-switch")
        try:
            resp = await client.post(decode + "/pd_role_switch", json={"new_role": "prefill"})
            assert resp.status_code == 400
            assert resp.json() == {"rid": None, "http_worker_ipc": None, "success": False,
                                   "message": "instance is not idle; drain all requests before switching",
                                   "old_role": "decode", "new_role": "prefill", "safe_to_restore": True}
            assert (await client.post(decode + "/abort_request", json={"rid": "busy-switch"})).status_code == 200
            rest = [e async for e in events]
            assert rest[-1] == b"[DONE]"
        finally:
            await cm.__aexit__(None, None, None)
        assert (await prefill).status_code == 200
        resp = await client.post(decode + "/pd_role_switch", json={"new_role": "prefill"})
        assert resp.status_code == 200
        assert resp.json() == {"rid": None, "http_worker_ipc": None, "success": True, "message": "ok",
                               "old_role": "decode", "new_role": "prefill", "safe_to_restore": False}
        info = (await client.get(decode + "/server_info")).json()  # the top level stays the launch config
        assert (info["disaggregation_mode"], info["internal_states"][0]["disaggregation_mode"]) == ("decode", "prefill")
        boot = await client.get(f"http://127.0.0.1:{engines['decode'].bootstrap_port}/health")
        assert boot.status_code == 200 and boot.text == "OK"  # the bootstrap server came up with the role
        resp = await client.post(decode + "/pd_role_switch", json={"new_role": "decode"})
        assert resp.status_code == 200 and resp.json()["old_role"] == "prefill"
        resp = await client.post(engines["null"].url + "/pd_role_switch", json={"new_role": "decode"})
        assert resp.status_code == 400 and resp.json()["message"] == "instance is not running in PD disaggregation mode"


@pytest.mark.asyncio
async def test_abort_mid_stream_ends_the_stream(engines: dict[str, Engine]) -> None:
    async with httpx.AsyncClient(timeout=30) as client:
        prefill, cm, events = await _start_long_pd_stream(client, engines, "abort-me")
        try:
            assert (await client.post(engines["decode"].url + "/abort_request", json={"rid": "abort-me"})
                    ).status_code == 200
            rest = [e async for e in events]
        finally:
            await cm.__aexit__(None, None, None)
        assert rest[-1] == b"[DONE]"
        last = orjson.loads(rest[-2])
        assert last["choices"][0]["finish_reason"] == "abort"
        await prefill
        loads = (await client.get(engines["decode"].url + "/v1/loads")).json()["loads"][0]
        assert loads["num_running_reqs"] == 0 and loads["num_used_tokens"] == 0
        metrics = (await client.get(engines["decode"].url + "/metrics")).text
        aborted = [ln for ln in metrics.splitlines() if ln.startswith("sglang:num_aborted_requests_total{")]
        assert aborted and float(aborted[0].rsplit(" ", 1)[1]) >= 1


@pytest.mark.asyncio
async def test_client_disconnect_aborts_the_request(engines: dict[str, Engine]) -> None:
    async with httpx.AsyncClient(timeout=30) as client:
        prefill, cm, events = await _start_long_pd_stream(client, engines, "walk-away")
        await cm.__aexit__(None, None, None)  # hang up mid-stream
        await prefill
        for _ in range(100):
            load = (await client.get(engines["decode"].url + "/v1/loads")).json()["loads"][0]
            if load["num_running_reqs"] == 0:
                break
            await asyncio.sleep(0.02)
        assert load["num_running_reqs"] == 0 and load["num_used_tokens"] == 0
