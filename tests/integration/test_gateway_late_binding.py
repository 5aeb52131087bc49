"""The gateway's late-binding prefill queue against real NATS, etcd and a PD pair of engine_sim processes.

Depth 1 and EDF: while a long prompt is being prefilled the prefill engine is "full", so the requests that
come next wait in the gateway; when the long prompt is done, the one with the earliest TTFT deadline goes
first, whatever the arrival order. Instances are registered in etcd directly (the sidecar's job, tested
elsewhere), as engine_kind ``sim``, so the engines also get each request's ``poise_slo``.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import time
from collections.abc import AsyncIterator, Iterator
from typing import Any

import httpx
import pytest
import pytest_asyncio

from services.gateway.service import GatewayService
from shared.devservers import EtcdServer, NatsServer
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

MODEL = "lb-model"
pytestmark = pytest.mark.asyncio
# time_scale 3: the long prompt (16k tokens) takes ~2 s to prefill on the default H100 profile, the short ones
# ~30 ms, so everything sent during the long prefill is held in the gateway.
TIME_SCALE = 3.0
LONG = {"model": MODEL, "prompt": [i % 1000 + 1 for i in range(16000)], "max_tokens": 2, "ignore_eos": True,
        "stream": True}


def short(tag: int, **extra: Any) -> dict[str, Any]:
    return {"model": MODEL, "prompt": [tag] * 100, "max_tokens": 4, "ignore_eos": True, "stream": True, **extra}


@pytest.fixture(scope="module")
def engines(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, SimEngine]]:
    tmp = tmp_path_factory.mktemp("lb-engines")
    started = {"prefill": SimEngine(tmp, "prefill", MODEL, TIME_SCALE, bootstrap_timeout_s=10),
               "decode": SimEngine(tmp, "decode", MODEL, TIME_SCALE, bootstrap_timeout_s=10)}
    yield from serving(started)


@pytest_asyncio.fixture
async def registry(etcd_server: EtcdServer) -> AsyncIterator[Registry]:
    async with fresh_registry(etcd_server) as reg:
        yield reg


def gateway(nats_server: NatsServer, etcd_server: EtcdServer,
            namespace: str) -> contextlib.AbstractAsyncContextManager[tuple[str, GatewayService]]:
    return run_gateway(nats_server, etcd_server, namespace, first_token_timeout_s=15, late_binding=True,
                       late_binding_policy="edf", late_binding_depth=1)


async def held_gauge(client: httpx.AsyncClient, url: str) -> float:
    text = (await client.get(url + "/metrics")).text
    match = re.search(r"^poise_gateway_late_binding_held_requests (\S+)$", text, re.MULTILINE)
    assert match, "the held-requests gauge is missing from /metrics"
    return float(match.group(1))


async def first_token_at(client: httpx.AsyncClient, url: str, body: dict[str, Any],
                         headers: dict[str, str] | None = None) -> tuple[float, int]:
    """Stream a completion; (monotonic time of its first token, tokens received)."""
    first: float | None = None
    tokens = 0
    async for chunk in completion_chunks(client, url, body, headers):
        if chunk.get("choices") and chunk["choices"][0].get("text"):
            first = first or time.monotonic()
            tokens += 1
    assert first is not None
    return first, tokens


async def test_edf_lets_an_urgent_request_overtake_held_ones(registry, engines, nats_server, etcd_server) -> None:  # type: ignore[no-untyped-def]
    regs = await register(registry, engines["prefill"].info("p0"), engines["decode"].info("d0"))
    async with gateway(nats_server, etcd_server, registry.keys.namespace) as (url, service), \
            httpx.AsyncClient(timeout=30) as client:
        await until(lambda: len(service.cluster.instances) == 2, 5)
        t0 = time.monotonic()
        long_task = asyncio.create_task(first_token_at(client, url, LONG))
        await until(lambda: service.cluster.inflight_total() > 0, 5)  # the long prompt is on the prefill engine
        relaxed = []
        lb = service.admission
        for tag in (1, 2, 3):  # arrive first, loose targets
            relaxed.append(asyncio.create_task(first_token_at(client, url, short(tag, slo={"ttft_s": 30.0}))))
            await until(lambda: lb.held == len(relaxed), 5)
        urgent = asyncio.create_task(first_token_at(client, url, short(9, slo={"ttft_s": 1.0, "name": "urgent"})))
        await until(lambda: lb.held == 4, 5)
        assert await held_gauge(client, url) == 4
        assert not long_task.done(), "the long prompt finished before everything was queued: raise TIME_SCALE"

        urgent_first, urgent_tokens = await urgent
        results = await asyncio.gather(*relaxed)
        long_first, long_tokens = await long_task
        assert urgent_tokens == 4 and all(n == 4 for _, n in results) and long_tokens == 2
        # The urgent request arrived last but got its first token before every request held ahead of it.
        assert all(urgent_first < first for first, _ in results), (urgent_first - t0, [f - t0 for f, _ in results])
        # The others kept their arrival order (EDF ties on equal slack go by arrival).
        firsts = [first for first, _ in results]
        assert firsts == sorted(firsts)
        await until(lambda: service.cluster.inflight_total() == 0, 5)
        assert await held_gauge(client, url) == 0
        text = (await client.get(url + "/metrics")).text
        assert re.search(r"^poise_gateway_late_binding_wait_seconds_count 5\.0$", text, re.MULTILINE), text
        # The long prompt named no SLO: it got the gateway's own, without a class; the others their own
        # targets, three without a name and one with a name the gateway does not know.
        by_rule = r'^poise_gateway_slo_class_requests_total\{slo_class="(.*)",source="(.*)"\} (\S+)$'
        counts = {(c, src): float(n) for c, src, n in re.findall(by_rule, text, re.MULTILINE)}
        assert counts == {("(none)", "gateway"): 1.0, ("(none)", "slo"): 3.0, ("(custom)", "slo"): 1.0}, counts
    for reg in regs:
        await reg.deregister()


async def test_a_clients_retry_waits_behind_a_first_send(registry, engines, nats_server, etcd_server) -> None:  # type: ignore[no-untyped-def]
    """The openai client names its retries (X-Stainless-Retry-Count): a retry with the earliest deadline still
    goes after the first send held with it, whose client can still be served in time."""
    regs = await register(registry, engines["prefill"].info("p0"), engines["decode"].info("d0"))
    async with gateway(nats_server, etcd_server, registry.keys.namespace) as (url, service), \
            httpx.AsyncClient(timeout=30) as client:
        await until(lambda: len(service.cluster.instances) == 2, 5)
        long_task = asyncio.create_task(first_token_at(client, url, LONG))
        await until(lambda: service.cluster.inflight_total() > 0, 5)
        lb = service.admission
        retry = asyncio.create_task(first_token_at(client, url, short(7, slo={"ttft_s": 1.0}),
                                                   {"x-stainless-retry-count": "1"}))
        await until(lambda: lb.held == 1, 5)
        first = asyncio.create_task(first_token_at(client, url, short(8, slo={"ttft_s": 30.0}),
                                                   {"x-stainless-retry-count": "0"}))
        await until(lambda: lb.held == 2, 5)
        assert not long_task.done(), "the long prompt finished before everything was queued: raise TIME_SCALE"
        (retry_first, retry_tokens), (first_first, first_tokens) = await asyncio.gather(retry, first)
        assert retry_tokens == first_tokens == 4
        assert first_first < retry_first, "the retry overtook the first send"
        await long_task
        await until(lambda: service.cluster.inflight_total() == 0, 5)
    for reg in regs:
        await reg.deregister()


async def test_held_requests_leave_cleanly(registry, engines, nats_server, etcd_server) -> None:  # type: ignore[no-untyped-def]
    """A client that hangs up while held is dropped; when the last prefill engine leaves, held requests fail
    with the same error as without late binding."""
    regs = await register(registry, engines["prefill"].info("p0"), engines["decode"].info("d0"))
    async with gateway(nats_server, etcd_server, registry.keys.namespace) as (url, service), \
            httpx.AsyncClient(timeout=30) as client:
        await until(lambda: len(service.cluster.instances) == 2, 5)
        assert service.admission.model.late_binding is not None
        lb = service.admission
        long_task = asyncio.create_task(first_token_at(client, url, LONG))
        await until(lambda: service.cluster.inflight_total() > 0, 5)
        gone = asyncio.create_task(client.post(url + "/v1/completions", json=short(1)))
        await until(lambda: lb.held == 1, 5)
        gone.cancel()  # the client hangs up while its request is held
        with contextlib.suppress(asyncio.CancelledError):
            await gone
        await until(lambda: lb.held == 0, 5)
        assert await held_gauge(client, url) == 0

        waiting = asyncio.create_task(client.post(url + "/v1/completions", json=short(2)))
        await until(lambda: lb.held == 1, 5)
        await regs[0].deregister()  # the only prefill engine leaves
        r = await waiting
        assert r.status_code == 503 and r.json()["error"]["code"] == "no_capacity", r.text
        assert lb.held == 0
        await long_task  # what was already on the engines finishes
        await until(lambda: service.cluster.inflight_total() == 0, 5)
    await regs[1].deregister()


async def test_with_early_rejection_a_request_held_past_its_target_is_refused(registry, engines, nats_server,  # type: ignore[no-untyped-def]
                                                                              etcd_server) -> None:
    """With early rejection on, the queue refuses a request that waited its whole TTFT target in it (no event
    comes meanwhile: the long prefill holds the only slot), with early rejection's retryable 429. Its long
    prompt is one the module's other tests never sent, so no engine holds it in its prefix cache."""
    regs = await register(registry, engines["prefill"].info("p0"), engines["decode"].info("d0"))
    async with run_gateway(nats_server, etcd_server, registry.keys.namespace, first_token_timeout_s=15,
                           late_binding=True, late_binding_policy="edf", late_binding_depth=1,
                           early_rejection=True) as (url, service), httpx.AsyncClient(timeout=30) as client:
        await until(lambda: len(service.cluster.instances) == 2, 5)
        lb = service.admission
        assert lb.model.late_binding is not None and lb.model.late_binding.guard_decode
        uncached = {**LONG, "prompt": [i % 1000 + 2001 for i in range(16000)]}
        long_task = asyncio.create_task(first_token_at(client, url, uncached))
        await until(lambda: service.cluster.inflight_total() > 0, 5)
        t0 = time.monotonic()
        held = asyncio.create_task(client.post(url + "/v1/completions", json=short(1, slo={"ttft_s": 0.3})))
        await until(lambda: lb.held == 1 or held.done(), 5)
        r = await held
        waited = time.monotonic() - t0
        assert r.status_code == 429 and r.json()["error"]["code"] == "slo_unreachable", r.text
        assert "held" in r.json()["error"]["message"] and r.headers.get("retry-after") == "1"
        assert 0.3 <= waited < 1.5 and not long_task.done(), waited  # refused by the timer, not the next event
        assert lb.held == 0
        await long_task
        await until(lambda: service.cluster.inflight_total() == 0, 5)
    for reg in regs:
        await reg.deregister()
