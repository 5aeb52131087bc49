"""A colocated engine that gives up a prompt waiting past its TTFT target (engine_sim ``--give-up-late-prompts``),
behind the gateway, against real NATS, etcd and engine_sim processes.

With early rejection the gateway refuses a request it holds past its TTFT target, so a request an engine gave
up for the same reason is not sent to another engine to be served late there: the client gets the engine's 429
at once. Without early rejection the gateway retries it on another pair, as it retries any busy engine's 429.
Either way the requests ahead of it are served in full."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator

import httpx
import pytest

from services.gateway.service import GatewayService
from shared.devservers import EtcdServer, NatsServer
from tests.integration.gateway_harness import SimEngine, counted, fresh_registry, register, run_gateway, serving

MODEL = "give-up-model"
BLOCKER_TOKENS = 300  # each engine's one running slot is held this long (~1-2 s at time scale 0.5)
pytestmark = pytest.mark.asyncio


@pytest.fixture(scope="module")
def engines(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, SimEngine]]:
    tmp = tmp_path_factory.mktemp("give-up-engines")
    flags = ("--max-running-requests", "1", "--prefill-policy", "fcfs", "--give-up-late-prompts")
    yield from serving({name: SimEngine(tmp, "null", MODEL, 0.5, extra_args=flags) for name in ("c0", "c1")})


async def _running(client: httpx.AsyncClient, engine: SimEngine) -> int:
    loads = (await client.get(engine.url + "/v1/loads")).json()["loads"][0]
    return int(loads["num_running_reqs"])


async def _late_request_behind_blockers(engines: dict[str, SimEngine], url: str, service: GatewayService,
                                        stream: bool = False) -> tuple[httpx.Response, list[httpx.Response]]:
    """Both engines busy with a long request each; then a request with a 0.2-s TTFT target (``stream``: the
    engine answers 200 and the refusal comes as the stream's error chunk, SGLang's way)."""
    deadline = time.monotonic() + 10
    while len(service.cluster.instances) < 2:
        assert time.monotonic() < deadline, "gateway did not see the engines"
        await asyncio.sleep(0.02)
    blocker = {"model": MODEL, "prompt": list(range(100)), "max_tokens": BLOCKER_TOKENS, "ignore_eos": True,
               "slo": {"ttft_s": 30.0}}
    async with httpx.AsyncClient(timeout=60) as client:
        blockers = [asyncio.create_task(client.post(url + "/v1/completions", json=blocker)) for _ in range(2)]
        deadline = time.monotonic() + 20
        while not all([await _running(client, e) == 1 for e in engines.values()]):
            assert time.monotonic() < deadline, "the blockers did not start on both engines"
            await asyncio.sleep(0.02)
        late = await client.post(url + "/v1/completions", json={
            "model": MODEL, "prompt": list(range(100)), "max_tokens": 4, "slo": {"ttft_s": 0.2}, "stream": stream})
        return late, list(await asyncio.gather(*blockers))


@pytest.mark.parametrize("stream", [False, True])
async def test_a_given_up_request_is_refused_not_retried_with_early_rejection(
        engines: dict[str, SimEngine], nats_server: NatsServer, etcd_server: EtcdServer, stream: bool) -> None:
    async with fresh_registry(etcd_server) as registry:
        await register(registry, engines["c0"].info("c0"), engines["c1"].info("c1"))
        async with run_gateway(nats_server, etcd_server, registry.keys.namespace, early_rejection=True,
                               retries=1) as (url, service):
            late, blockers = await _late_request_behind_blockers(engines, url, service, stream)
    assert late.status_code == 429, late.text
    error = late.json()["error"]
    assert error["type"] == "rate_limit_error" and "past its TTFT target of 0.2 s" in error["message"], error
    assert late.headers.get("retry-after") == "1"
    assert counted(service, "poise_gateway_retries_total") == 0
    assert [b.json()["usage"]["completion_tokens"] for b in blockers] == [BLOCKER_TOKENS] * 2


async def test_without_early_rejection_the_gateway_retries_it_on_another_pair(
        engines: dict[str, SimEngine], nats_server: NatsServer, etcd_server: EtcdServer) -> None:
    async with fresh_registry(etcd_server) as registry:
        await register(registry, engines["c0"].info("c0"), engines["c1"].info("c1"))
        async with run_gateway(nats_server, etcd_server, registry.keys.namespace, early_rejection=False,
                               retries=1) as (url, service):
            late, blockers = await _late_request_behind_blockers(engines, url, service)
    assert late.status_code == 429, late.text  # the other engine, busy too, gave it up as well
    assert counted(service, "poise_gateway_retries_total") == 1
    assert [b.json()["usage"]["completion_tokens"] for b in blockers] == [BLOCKER_TOKENS] * 2
