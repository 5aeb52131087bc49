"""Prefix-aware dispatch through the gateway, against real NATS, etcd and two colocated engine_sim processes
with their radix cache: a prompt that shares a prefix with an earlier one goes where that prefix is cached,
and the engine serves it from its cache (the cached tokens it reports in the usage)."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from typing import Any

import httpx
import pytest
import pytest_asyncio

from loadgen.prompts import prompt_token_ids
from shared.bus import Bus
from shared.devservers import EtcdServer, NatsServer
from shared.protocol import RequestEvent, RequestEventBatch, Subjects
from shared.registry import Registry
from tests.integration.gateway_harness import SimEngine, fresh_registry, register, run_gateway, serving
from tests.integration.waiting import until

MODEL = "prefix-model"
pytestmark = pytest.mark.asyncio


@pytest.fixture(scope="module")
def engines(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, SimEngine]]:
    tmp = tmp_path_factory.mktemp("prefix-engines")
    yield from serving({name: SimEngine(tmp, "null", MODEL, 0.05, extra_args=("--enable-cache-report",))
                        for name in ("c0", "c1")})


@pytest_asyncio.fixture
async def registry(etcd_server: EtcdServer) -> AsyncIterator[Registry]:
    async with fresh_registry(etcd_server) as reg:
        yield reg


async def complete(client: httpx.AsyncClient, url: str, index: int, blocks: list[int]) -> dict[str, Any]:
    body = {"model": MODEL, "prompt": prompt_token_ids(index, 512 * len(blocks), blocks), "max_tokens": 4,
            "ignore_eos": True}
    r = await client.post(url + "/v1/completions", json=body)
    assert r.status_code == 200, r.text
    return r.json()["usage"]


@pytest.mark.parametrize("policy", ["cache-aware", "arrow"])
async def test_a_shared_prefix_goes_where_it_is_cached(policy: str, registry: Registry, engines: dict[str, SimEngine],
                                                       nats_server: NatsServer, etcd_server: EtcdServer) -> None:
    regs = await register(registry, engines["c0"].info("c0"), engines["c1"].info("c1"))
    bus = Bus(nats_server.url, name="test-events")
    await bus.connect()
    events: list[RequestEvent] = []

    async def on_batch(batch: RequestEventBatch, _: str) -> None:
        events.extend(batch.events)

    await bus.subscribe(Subjects(registry.keys.namespace).request_events(), RequestEventBatch, on_batch)
    try:
        async with run_gateway(nats_server, etcd_server, registry.keys.namespace, dispatch_policy=policy) as (
                url, service), httpx.AsyncClient(timeout=30) as client:
            await until(lambda: len(service.cluster.instances) == 2, 5)
            base = 1000 if policy == "arrow" else 2000  # the engines' caches outlive one parametrized run
            # With both engines idle every policy breaks the tie towards c0, and a load-only policy keeps
            # doing so; a long stream there first sends the conversation's first turn to c1.
            blocker = {"model": MODEL, "prompt": prompt_token_ids(0, 64, [base - 1]), "max_tokens": 3000,
                       "ignore_eos": True, "stream": True}
            async with client.stream("POST", url + "/v1/completions", json=blocker) as stream:
                assert stream.status_code == 200
                lines = stream.aiter_lines()
                await anext(lines)
                first = await complete(client, url, 1, [base + i for i in range(8)])
                async for _ in lines:
                    pass
            assert first["prompt_tokens_details"]["cached_tokens"] == 0
            # The next turns extend the first: their prefix is cached on c1 only, and each policy sends
            # them there although c0 is as idle (least-load would pick c0, which caches none of it).
            for turn in range(2, 5):
                usage = await complete(client, url, turn, [base + i for i in range(8 * turn)])
                assert usage["prompt_tokens_details"]["cached_tokens"] == 512 * 8 * (turn - 1), (policy, turn)
            # The engines' counts reach the monitor's events, where the planners price uncached prefill.
            await until(lambda: len(events) >= 5, 10)
            assert sorted(e.cached_tokens for e in events if e.input_tokens >= 4096) == [0, 4096, 8192, 12288]
    finally:
        await bus.close()
        for reg in regs:
            await reg.deregister()
