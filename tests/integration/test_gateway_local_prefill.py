"""DOPD's local prefill through the gateway, against real NATS, etcd and a PD pair of engine_sim processes.

With ``local_prefill_max_tokens`` a short prompt goes to the decode engine alone (``poise_local_prefill``),
which prefills it itself: the prefill engine never sees it, and the client gets the same stream and usage as
through the pair. A long prompt still takes the prefill engine, and a decode engine registered as SGLang
(which cannot prefill in PD decode mode) never gets a request without its prefill peer.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import time
from collections.abc import AsyncIterator, Iterator
from typing import Any

import httpx
import msgspec
import pytest
import pytest_asyncio

from shared.devservers import EtcdServer, NatsServer
from shared.protocol import InstanceInfo
from shared.registry import Registry
from tests.integration.gateway_harness import (
    SimEngine,
    completion_chunks,
    fresh_registry,
    register,
    run_gateway,
    serving,
)
from tests.integration.waiting import until

MODEL = "local-model"
pytestmark = pytest.mark.asyncio


@pytest.fixture(scope="module")
def engines(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, SimEngine]]:
    tmp = tmp_path_factory.mktemp("local-prefill-engines")
    yield from serving({"prefill": SimEngine(tmp, "prefill", MODEL, 0.2), "decode": SimEngine(tmp, "decode", MODEL, 0.2)})


@pytest_asyncio.fixture
async def registry(etcd_server: EtcdServer) -> AsyncIterator[Registry]:
    async with fresh_registry(etcd_server) as reg:
        yield reg


def body(prompt_tokens: int) -> dict[str, Any]:
    return {"model": MODEL, "prompt": [7] * prompt_tokens, "max_tokens": 6, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}


async def stream(client: httpx.AsyncClient, url: str, prompt_tokens: int) -> tuple[int, dict[str, Any]]:
    """(tokens of text, final usage) of one streamed completion. engine_sim renders each token as " tok<id>",
    and a chunk carries every token made since the last one was sent (several when the stream fell behind)."""
    chunks, final = 0, {}
    async for chunk in completion_chunks(client, url, body(prompt_tokens)):
        assert "poise_local_prefill" not in chunk
        if chunk.get("choices"):
            chunks += str(chunk["choices"][0].get("text") or "").count(" tok")
        if chunk.get("usage"):
            final = chunk["usage"]
    return chunks, final


async def prompt_tokens_seen(client: httpx.AsyncClient, engine: SimEngine) -> float:
    """The engine's sglang:prompt_tokens_total over its label sets (streaming and not)."""
    text = (await client.get(engine.url + "/metrics")).text
    return sum(float(v) for v in re.findall(r"^sglang:prompt_tokens_total\{[^}]*\} (\S+)$", text, re.MULTILINE))


async def settled(client: httpx.AsyncClient, service: Any, engine: SimEngine) -> float:
    """Prompt tokens the engine counted once every request is done (a prefill engine counts a request when its
    decode peer releases the KV, just after the client's stream ends)."""
    await until(lambda: service.cluster.inflight_total() == 0, 5)
    deadline = time.monotonic() + 10
    while True:  # the engine holds nothing (its KV released): every request it had is counted
        load = (await client.get(engine.url + "/v1/loads")).json()["loads"][0]
        if load["num_running_reqs"] == load["num_waiting_reqs"] == load["num_used_tokens"] == 0:
            return await prompt_tokens_seen(client, engine)
        assert time.monotonic() < deadline, f"the engine still holds requests: {load}"
        await asyncio.sleep(0.02)


async def kept_local(client: httpx.AsyncClient, url: str) -> float:
    """Requests the gateway's dispatch kept on their decode engine, as its /metrics counts them."""
    text = (await client.get(url + "/metrics")).text
    found = re.findall(r'^poise_gateway_placement_stages_total\{stage="local-prefill"\} (\S+)$', text, re.MULTILINE)
    return sum(float(v) for v in found)


def usage(prompt: int) -> dict[str, int]:
    return {"prompt_tokens": prompt, "completion_tokens": 6, "total_tokens": prompt + 6}


@contextlib.asynccontextmanager
async def gateway(registry: Registry, nats_server: NatsServer, etcd_server: EtcdServer, *infos: InstanceInfo,
                  ) -> AsyncIterator[tuple[str, Any, httpx.AsyncClient]]:
    """A gateway with local prefill at 512 tokens in front of the engines registered as ``infos``."""
    regs = await register(registry, *infos)
    async with run_gateway(nats_server, etcd_server, registry.keys.namespace, local_prefill_max_tokens=512) as (
            url, service), httpx.AsyncClient(timeout=30) as client:
        await until(lambda: len(service.cluster.instances) == len(infos), 5)
        yield url, service, client
    for reg in regs:
        await reg.deregister()


async def test_short_prompts_are_prefilled_on_the_decode_engine(registry, engines, nats_server, etcd_server) -> None:  # type: ignore[no-untyped-def]
    async with gateway(registry, nats_server, etcd_server, engines["prefill"].info("p0"),
                       engines["decode"].info("d0")) as (url, service, client):
        before = await settled(client, service, engines["prefill"])
        chunks, got = await stream(client, url, 100)
        assert chunks == 6 and usage(100).items() <= got.items()
        assert await settled(client, service, engines["prefill"]) == before  # never reached the prefill engine
        chunks, got = await stream(client, url, 2000)
        assert chunks == 6 and usage(2000).items() <= got.items()
        assert await settled(client, service, engines["prefill"]) == before + 2000
        assert await kept_local(client, url) == 1


async def test_sglang_decode_engines_never_get_a_local_prefill(registry, engines, nats_server, etcd_server) -> None:  # type: ignore[no-untyped-def]
    as_sglang = msgspec.structs.replace(engines["decode"].info("d0"), engine_kind="sglang")
    async with gateway(registry, nats_server, etcd_server, engines["prefill"].info("p0"), as_sglang) as (
            url, service, client):
        before = await settled(client, service, engines["prefill"])
        chunks, got = await stream(client, url, 100)
        assert chunks == 6 and usage(100).items() <= got.items()
        assert await settled(client, service, engines["prefill"]) == before + 100
        assert await kept_local(client, url) == 0
