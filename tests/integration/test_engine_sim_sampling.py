"""What engine_sim does with the OpenAI sampling fields: ``seed`` gives the same answer on any engine, ``stop``
ends the answer before the stop string (also on a PD pair, whose first token comes from the prefill peer),
``logprobs`` come back in the endpoint's shape, and what it cannot honour (``response_format`` other than text,
a forced ``tool_choice``) is refused with a 400 naming it, never accepted and dropped."""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Iterator
from typing import Any

import httpx
import orjson
import pytest

from tests.integration.engine_procs import Engine, start_engine, stop, wait_healthy

MODEL = "meta-llama/Llama-3.1-8B-Instruct"
_rooms = itertools.count(5000)


@pytest.fixture(scope="module")
def engines(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Engine]]:
    tmp = tmp_path_factory.mktemp("engine_sim_sampling")
    started = {"a": start_engine(tmp, "null", "--seed", "0", time_scale=0.02, name="a"),
               "b": start_engine(tmp, "null", "--seed", "1", time_scale=0.02, name="b"),
               "prefill": start_engine(tmp, "prefill", "--seed", "2", time_scale=0.02, name="pd"),
               "decode": start_engine(tmp, "decode", "--seed", "3", time_scale=0.02, name="pd")}
    try:
        wait_healthy(list(started.values()))
        yield started
    finally:
        stop(list(started.values()))


def completion(prompt: str = "Tell me a story about a fox. " * 8, **extra: Any) -> dict[str, Any]:
    return {"model": MODEL, "prompt": prompt, "max_tokens": 40, "ignore_eos": True, **extra}


def chat(**extra: Any) -> dict[str, Any]:
    return {"model": MODEL, "messages": [{"role": "user", "content": "Tell me about foxes."}], "max_tokens": 30,
            "ignore_eos": True, **extra}


async def post(engine: Engine, path: str, body: dict[str, Any]) -> httpx.Response:
    async with httpx.AsyncClient(timeout=30) as client:
        return await client.post(engine.url + path, json=body)


async def streamed(engine: Engine, path: str, body: dict[str, Any]) -> list[dict[str, Any]]:
    chunks = []
    async with httpx.AsyncClient(timeout=30) as client, client.stream(
            "POST", engine.url + path, json={**body, "stream": True}) as resp:
        assert resp.status_code == 200
        async for line in resp.aiter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunks.append(orjson.loads(line[6:]))
    return [c for c in chunks if c["choices"]]


async def pd(engines: dict[str, Engine], body: dict[str, Any]) -> dict[str, Any]:
    body = {**body, "bootstrap_host": "127.0.0.1", "bootstrap_port": engines["prefill"].bootstrap_port,
            "bootstrap_room": next(_rooms)}
    prefill = asyncio.create_task(post(engines["prefill"], "/v1/completions", body))
    decode = await post(engines["decode"], "/v1/completions", body)
    assert (await prefill).status_code == 200 and decode.status_code == 200, decode.text
    return decode.json()["choices"][0]


@pytest.mark.asyncio
async def test_a_request_seed_gives_the_same_answer_on_engines_with_other_seeds(engines: dict[str, Engine]) -> None:
    texts = [(await post(engines[e], "/v1/completions", completion(**seed))).json()["choices"][0]["text"]
             for seed in ({"seed": 7}, {}) for e in ("a", "b")]
    assert texts[0] == texts[1], "the request's seed decides the answer"
    assert texts[2] != texts[3], "without one each engine's own seed does"
    other = (await post(engines["a"], "/v1/completions", completion(seed=8))).json()["choices"][0]["text"]
    assert other != texts[0]


@pytest.mark.asyncio
@pytest.mark.parametrize("where", ["colocated", "pd"])
async def test_a_stop_string_ends_the_answer_before_it(engines: dict[str, Engine], where: str) -> None:
    async def answer(**extra: Any) -> dict[str, Any]:
        if where == "pd":
            return await pd(engines, completion(**extra))
        resp = await post(engines["a"], "/v1/completions", completion(**extra))
        assert resp.status_code == 200, resp.text
        return resp.json()["choices"][0]

    free = (await answer())["text"]
    stop_at = free.index(" ", len(free) // 2)
    stop = free[stop_at:stop_at + 6]  # spans a word boundary: " tok12" / "3 tok4"
    cut = await answer(stop=["never-in-the-text", stop])
    assert cut["text"] == free[:free.index(stop)]
    assert (cut["finish_reason"], cut["matched_stop"]) == ("stop", stop)
    if where == "colocated":
        chunks = await streamed(engines["a"], "/v1/completions", completion(stop=stop))
        assert "".join(c["choices"][0]["text"] for c in chunks) == cut["text"]
        assert chunks[-1]["choices"][0]["finish_reason"] == "stop"


@pytest.mark.asyncio
async def test_logprobs_come_back_for_every_token_in_the_endpoints_shape(engines: dict[str, Engine]) -> None:
    whole = (await post(engines["a"], "/v1/chat/completions", chat(logprobs=True, top_logprobs=3))).json()
    content = whole["choices"][0]["logprobs"]["content"]
    assert len(content) == whole["usage"]["completion_tokens"] == 30
    assert "".join(e["token"] for e in content) == whole["choices"][0]["message"]["content"]
    for e in content:
        assert bytes(e["bytes"]) == e["token"].encode() and e["logprob"] <= 0
        assert len(e["top_logprobs"]) == 3 and e["top_logprobs"][0]["logprob"] == e["logprob"]
    chunks = await streamed(engines["a"], "/v1/chat/completions", chat(logprobs=True, top_logprobs=3))
    assert [e for c in chunks if c["choices"][0]["logprobs"] for e in c["choices"][0]["logprobs"]["content"]] == content
    # an answer that ends at its end-of-turn token: that token's log-probability is in the whole answer only
    ended = chat(logprobs=True, max_tokens=3000, ignore_eos=False)
    whole_ended = (await post(engines["a"], "/v1/chat/completions", ended)).json()["choices"][0]
    assert whole_ended["finish_reason"] == "stop" and whole_ended["logprobs"]["content"][-1]["token"] == ""
    chunks = await streamed(engines["a"], "/v1/chat/completions", ended)
    assert [e for c in chunks if c["choices"][0]["logprobs"] for e in c["choices"][0]["logprobs"]["content"]] == \
        whole_ended["logprobs"]["content"][:-1]
    plain = (await post(engines["a"], "/v1/chat/completions", chat())).json()
    assert plain["choices"][0]["logprobs"] is None

    text = (await post(engines["a"], "/v1/completions", completion(logprobs=2))).json()["choices"][0]
    lp = text["logprobs"]
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == 40
    assert "".join(lp["tokens"]) == text["text"]
    assert lp["text_offset"] == [text["text"].index(t, o) for t, o in zip(lp["tokens"], lp["text_offset"], strict=True)]
    assert all(len(top) == 2 for top in lp["top_logprobs"])


@pytest.mark.asyncio
@pytest.mark.parametrize(("extra", "named"), [
    ({"response_format": {"type": "json_object"}}, "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {}}}}, "response_format"),
    ({"tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": "required"}, "tool_choice"),
    ({"tools": [{"type": "function", "function": {"name": "f"}}],
      "tool_choice": {"type": "function", "function": {"name": "f"}}}, "tool_choice"),
])
async def test_what_engine_sim_cannot_honour_is_refused_naming_it(engines: dict[str, Engine], extra: dict[str, Any],
                                                                 named: str) -> None:
    resp = await post(engines["a"], "/v1/chat/completions", chat(**extra))
    assert resp.status_code == 400 and named in resp.json()["message"], resp.text


@pytest.mark.asyncio
async def test_what_leaves_the_text_free_is_served(engines: dict[str, Engine]) -> None:
    for extra in ({"response_format": {"type": "text"}},
                  {"tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": "auto"}):
        resp = await post(engines["a"], "/v1/chat/completions", chat(**extra))
        assert resp.status_code == 200, resp.text
