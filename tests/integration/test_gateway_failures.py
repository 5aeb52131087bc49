"""The gateway against real NATS, etcd and engine_sim processes: retries, aborts, rejections, auth.

Instances are registered in etcd directly (the sidecar's job, tested elsewhere), so a test can register an
engine that is not there and watch the gateway route around it.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import socket
import time
import uuid
from collections.abc import AsyncIterator, Iterator

import httpx
import orjson
import pytest
import pytest_asyncio

from services.gateway.legs import Attempt
from services.gateway.service import GatewayService
from shared.bus import Bus
from shared.devservers import EtcdServer, NatsServer, wait_for_port
from shared.protocol import Keys, LoadReport, Subjects
from shared.registry import Registry
from tests.integration.gateway_harness import SimEngine, counted, engine_info, register, run_gateway, streamed_tokens
from tests.integration.waiting import until

MODEL = "test-model"
pytestmark = pytest.mark.asyncio


@pytest.fixture(scope="module")
def engines(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, SimEngine]]:
    tmp = tmp_path_factory.mktemp("gw-engines")
    # time_scale 0.2: a 1000-token stream lasts ~1.5 s, long enough to hang up in the middle of it.
    started = {"prefill": SimEngine(tmp, "prefill", MODEL, 0.2), "decode": SimEngine(tmp, "decode", MODEL, 0.2)}
    for e in started.values():
        wait_for_port("127.0.0.1", e.port, 30, e.proc.proc)
    yield started
    for e in started.values():
        e.proc.stop()


def _dead_port() -> int:
    # A port nothing listens on: connecting fails at once, like an engine that just died.
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest_asyncio.fixture
async def cluster(nats_server: NatsServer, etcd_server: EtcdServer) -> AsyncIterator[tuple[Registry, str]]:
    namespace = f"t{uuid.uuid4().hex[:8]}"
    registry = Registry(etcd_server.url, Keys(namespace))
    await registry.connect()
    yield registry, namespace
    await registry.close()


def gateway(nats_server: NatsServer, etcd_server: EtcdServer, namespace: str,
            **overrides: object) -> contextlib.AbstractAsyncContextManager[tuple[str, GatewayService]]:
    return run_gateway(nats_server, etcd_server, namespace, **{"first_token_timeout_s": 10, **overrides})


async def wait_instances(service: GatewayService, n: int) -> None:
    deadline = time.monotonic() + 5
    while len(service.cluster.instances) < n:
        assert time.monotonic() < deadline, "gateway did not see the instances"
        await asyncio.sleep(0.02)


BODY = {"model": MODEL, "prompt": list(range(100)), "max_tokens": 16, "ignore_eos": True}


async def first_attempt(service: GatewayService, timeout_s: float = 10.0) -> Attempt:
    """The attempt of the one request in flight, once it is dispatched (polled with a deadline)."""
    deadline = time.monotonic() + timeout_s
    while not service.flows or next(iter(service.flows.values())).attempt is None:
        assert time.monotonic() < deadline, "the request was never dispatched"
        await asyncio.sleep(0.02)
    attempt = next(iter(service.flows.values())).attempt
    assert attempt is not None
    return attempt


async def test_retries_on_another_pair_when_a_leg_is_dead(cluster, engines, nats_server, etcd_server) -> None:  # type: ignore[no-untyped-def]
    registry, ns = cluster
    # "d0" sorts first, so least-load tries the dead engine first and must retry on d1.
    await register(registry, engines["prefill"].info("p0"), engine_info("d0", "decode", f"http://127.0.0.1:{_dead_port()}", None, MODEL),
                   engines["decode"].info("d1"))
    async with gateway(nats_server, etcd_server, ns) as (url, service):
        await wait_instances(service, 3)
        async with httpx.AsyncClient(timeout=30) as client:
            r = await client.post(url + "/v1/completions", json=BODY)
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] == 16
        assert counted(service, "poise_gateway_retries_total") == 1  # type: ignore[attr-defined]


async def test_both_attempts_failing_is_a_502_not_a_hang(cluster, engines, nats_server, etcd_server) -> None:  # type: ignore[no-untyped-def]
    registry, ns = cluster
    await register(registry, engines["prefill"].info("p0"),
                   engine_info("d0", "decode", f"http://127.0.0.1:{_dead_port()}", None, MODEL),
                   engine_info("d1", "decode", f"http://127.0.0.1:{_dead_port()}", None, MODEL))
    async with gateway(nats_server, etcd_server, ns) as (url, service):
        await wait_instances(service, 3)
        async with httpx.AsyncClient(timeout=30) as client:
            r = await client.post(url + "/v1/completions", json=BODY)
            assert r.status_code == 502
            assert r.json()["error"]["code"] == "engine_error"
            # The prefill engine must not be left holding the aborted requests.
            loads = (await client.get(engines["prefill"].url + "/v1/loads")).json()["loads"][0]
            assert loads["num_running_reqs"] == 0 and loads["num_waiting_reqs"] == 0


async def test_client_disconnect_aborts_both_legs(cluster, engines, nats_server, etcd_server) -> None:  # type: ignore[no-untyped-def]
    registry, ns = cluster
    await register(registry, engines["prefill"].info("p0"), engines["decode"].info("d0"))
    async with gateway(nats_server, etcd_server, ns) as (url, service):
        await wait_instances(service, 2)
        async with httpx.AsyncClient(timeout=30) as client:
            body = {**BODY, "max_tokens": 1000, "stream": True}
            async with client.stream("POST", url + "/v1/completions", json=body) as r:
                assert r.status_code == 200
                lines = 0
                async for line in r.aiter_lines():
                    lines += line.startswith("data:")
                    if lines >= 5:
                        break  # hang up mid-stream
            deadline = time.monotonic() + 5
            while True:
                loads = (await client.get(engines["decode"].url + "/v1/loads")).json()["loads"][0]
                if loads["num_running_reqs"] == 0:
                    break
                assert time.monotonic() < deadline, f"decode engine still running the request: {loads}"
                await asyncio.sleep(0.05)
            metrics = (await client.get(engines["decode"].url + "/metrics")).text
        assert "sglang:num_aborted_requests_total" in metrics
        deadline = time.monotonic() + 5
        while service.cluster.inflight_total():  # the gateway released its slots too
            assert time.monotonic() < deadline
            await asyncio.sleep(0.02)
        assert counted(service, "poise_gateway_requests_total", endpoint="completions", status="aborted") == 1


async def test_no_engines_is_503_and_unknown_model_is_404(cluster, engines, nats_server, etcd_server) -> None:  # type: ignore[no-untyped-def]
    registry, ns = cluster
    async with gateway(nats_server, etcd_server, ns) as (url, service), httpx.AsyncClient(timeout=30) as client:
        r = await client.post(url + "/v1/completions", json=BODY)
        assert r.status_code == 503 and r.json()["error"]["code"] == "no_capacity"
        await register(registry, engines["decode"].info("d0"))  # a decode engine alone cannot serve
        await wait_instances(service, 1)
        r = await client.post(url + "/v1/completions", json=BODY)
        assert r.status_code == 503 and "no ready prefill+decode pair" in r.json()["error"]["message"]
        r = await client.post(url + "/v1/completions", json={**BODY, "model": "other"})
        assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"


async def test_full_engines_get_429_with_retry_after(cluster, engines, nats_server, etcd_server) -> None:  # type: ignore[no-untyped-def]
    registry, ns = cluster
    await register(registry, engines["prefill"].info("p0"), engines["decode"].info("d0"))
    async with gateway(nats_server, etcd_server, ns, max_pending_per_engine=2) as (url, service):
        await wait_instances(service, 2)
        async with httpx.AsyncClient(timeout=60) as client:
            long = {**BODY, "max_tokens": 400}
            results = await asyncio.gather(*(client.post(url + "/v1/completions", json=long) for _ in range(5)))
        codes = sorted(r.status_code for r in results)
        assert codes.count(200) >= 2 and 429 in codes, codes
        rejected = next(r for r in results if r.status_code == 429)
        assert rejected.headers["retry-after"] == "1" and rejected.json()["error"]["type"] == "rate_limit_error"


@pytest.mark.parametrize("role", ["decode", "null"])
async def test_a_request_the_backlog_would_make_late_is_refused_early(cluster, engines, nats_server,  # type: ignore[no-untyped-def]
                                                                      etcd_server, role, tmp_path) -> None:
    """Early rejection live: once the gateway has seen requests leave the decode (or colocated) engine (its
    rate) and the engine's load reports have shown for a second a queue (waiting for KV; a colocated engine's
    waiting queue) that would keep a request from starting within the TTFT target, the next request is a 429
    slo_unreachable at once; when the queue is gone, requests are served again. The load reports are
    published on NATS as the engine's sidecar would."""
    registry, ns = cluster
    colocated = None
    if role == "decode":
        judged = "d0"
        await register(registry, engines["prefill"].info("p0"), engines["decode"].info(judged))
    else:
        judged = "c0"
        colocated = SimEngine(tmp_path, "null", MODEL, 0.2)
        wait_for_port("127.0.0.1", colocated.port, 30, colocated.proc.proc)
        await register(registry, colocated.info(judged))
    bus = Bus(nats_server.url, name="test-sidecar")
    await bus.connect()

    async def report(waiting: int) -> None:
        kv_waiting = waiting if role == "decode" else 0
        await bus.publish(Subjects(ns).load(judged), LoadReport(
            instance_id=judged, role=role, status="ready", ts_unix_s=time.time(), num_waiting_reqs=waiting,
            decode_queue_reqs=kv_waiting, decode_kv_waiting_reqs=kv_waiting))
        await until(lambda: any(e.instance_id == judged and e.waiting_reqs == waiting
                                for e in service.cluster.engines(MODEL)), 5)

    try:
        async with gateway(nats_server, etcd_server, ns, early_rejection=True, slo_ttft_s=2.0) as (url, service), \
                httpx.AsyncClient(timeout=60) as client:
            await wait_instances(service, 2 if role == "decode" else 1)
            await report(40)  # before the gateway has a rate: nothing to judge on, requests go through
            queued = time.monotonic()
            for _ in range(8):  # 8 requests leave the engine: a rate of 8 per 30 s
                assert (await client.post(url + "/v1/completions", json=BODY)).status_code == 200
            # The rule is time-based: a queue is judged once it has lasted a second (the first request saw it).
            await until(lambda: time.monotonic() - queued > 1.1, 5)
            r = await client.post(url + "/v1/completions", json=BODY)  # 40 waiting at ~0.27/s: ~150 s
            assert r.status_code == 429 and r.headers["retry-after"] == "1", r.text
            error = r.json()["error"]
            assert error["type"] == "rate_limit_error" and error["code"] == "slo_unreachable"
            assert "early rejection" in error["message"] and judged in error["message"]
            assert counted(service, "poise_gateway_rejections_total", reason="slo_unreachable") == 1
            await report(0)
            assert (await client.post(url + "/v1/completions", json=BODY)).status_code == 200
    finally:
        await bus.close()
        if colocated is not None:
            colocated.proc.stop()


async def test_api_keys_are_enforced(cluster, engines, nats_server, etcd_server) -> None:  # type: ignore[no-untyped-def]
    registry, ns = cluster
    await register(registry, engines["prefill"].info("p0"), engines["decode"].info("d0"))
    async with gateway(nats_server, etcd_server, ns, api_keys=["sekrit"]) as (url, service):
        await wait_instances(service, 2)
        async with httpx.AsyncClient(timeout=30) as client:
            r = await client.post(url + "/v1/completions", json=BODY)
            assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
            r = await client.post(url + "/v1/completions", json=BODY, headers={"authorization": "Bearer sekrit"})
            assert r.status_code == 200


async def test_non_streaming_client_that_hangs_up_aborts_the_request(cluster, engines, nats_server, etcd_server) -> None:  # type: ignore[no-untyped-def]
    registry, ns = cluster
    await register(registry, engines["prefill"].info("p0"), engines["decode"].info("d0"))
    async with gateway(nats_server, etcd_server, ns) as (url, service):
        await wait_instances(service, 2)
        async with httpx.AsyncClient(timeout=30) as client:
            with contextlib.suppress(httpx.ReadTimeout):  # give up long before 1000 tokens are done
                await client.post(url + "/v1/completions", json={**BODY, "max_tokens": 1000}, timeout=0.5)
            deadline = time.monotonic() + 5
            while service.cluster.inflight_total():
                assert time.monotonic() < deadline, "the gateway kept the abandoned request"
                await asyncio.sleep(0.02)
            loads = (await client.get(engines["decode"].url + "/v1/loads")).json()["loads"][0]
        assert loads["num_running_reqs"] == 0
        assert counted(service, "poise_gateway_requests_total", endpoint="completions", status="aborted") == 1


async def test_hanging_up_before_the_first_token_aborts_the_prefill(cluster, engines, nats_server, etcd_server) -> None:  # type: ignore[no-untyped-def]
    registry, ns = cluster
    await register(registry, engines["prefill"].info("p0"), engines["decode"].info("d0"))
    async with gateway(nats_server, etcd_server, ns) as (url, service):
        await wait_instances(service, 2)
        # ~100K prompt tokens: about 1.7 s of prefill at time_scale 0.2, so the client leaves while it runs.
        body = {**BODY, "prompt": list(range(100_000)), "stream": True}
        async with httpx.AsyncClient(timeout=30) as client:
            with contextlib.suppress(httpx.ReadTimeout):
                async with client.stream("POST", url + "/v1/completions", json=body, timeout=0.5) as r:
                    await r.aread()
            # Left alone, the prefill would run ~1.2 s more; aborted, the engine is idle well before that.
            deadline = time.monotonic() + 0.8
            while True:
                loads = (await client.get(engines["prefill"].url + "/v1/loads")).json()["loads"][0]
                if loads["num_running_reqs"] == 0 and loads["num_waiting_reqs"] == 0:
                    break
                assert time.monotonic() < deadline, f"prefill engine still busy with the abandoned request: {loads}"
                await asyncio.sleep(0.05)
        assert counted(service, "poise_gateway_requests_total", endpoint="completions", status="aborted") == 1


async def test_a_stalled_decode_engine_has_its_streams_rescued(cluster, engines, nats_server, etcd_server,  # type: ignore[no-untyped-def]
                                                               tmp_path) -> None:
    """SIGSTOP of the decode engine mid-stream: no token for stall_timeout_s, so the stream is resumed on the
    other decode engine and the client gets every token, in time; the stopped engine stays registered."""
    registry, ns = cluster
    other = SimEngine(tmp_path, "decode", MODEL, 0.2)
    wait_for_port("127.0.0.1", other.port, 30, other.proc.proc)
    await register(registry, engines["prefill"].info("p0"), engines["decode"].info("d0"), other.info("d1"))
    stopped: int | None = None
    try:
        async with gateway(nats_server, etcd_server, ns, stall_timeout_s=1.0, dispatch_policy="round-robin") as (url, service):
            await wait_instances(service, 3)
            async with httpx.AsyncClient(timeout=60) as client:
                body = {**BODY, "max_tokens": 400, "stream": True, "stream_options": {"include_usage": True}}
                t0 = time.monotonic()
                async with client.stream("POST", url + "/v1/completions", json=body) as r:
                    assert r.status_code == 200
                    usage = None
                    async for line in r.aiter_lines():
                        if stopped is None and line.startswith("data:") and '"text"' in line:
                            flow = next(iter(service.flows.values()))
                            assert flow.attempt is not None
                            victim = engines["decode"] if flow.attempt.decode.instance_id == "d0" else other
                            stopped = victim.proc.proc.pid
                            os.kill(stopped, signal.SIGSTOP)
                        if line.startswith("data: {") and '"usage"' in line:
                            usage = orjson.loads(line[6:]).get("usage") or usage
                elapsed = time.monotonic() - t0
        assert usage is not None and usage["completion_tokens"] == 400
        assert counted(service, "poise_gateway_stalled_streams_total") == 1 and counted(service, "poise_gateway_rescues_total") == 1  # type: ignore[attr-defined]
        assert elapsed < 20  # ~1 s of stall detection, not the request deadline
    finally:
        if stopped is not None:
            os.kill(stopped, signal.SIGCONT)
        other.proc.stop()


async def test_a_request_waiting_on_an_engine_that_leaves_the_registry_is_tried_on_another_pair(  # type: ignore[no-untyped-def]
        cluster, engines, nats_server, etcd_server, tmp_path) -> None:
    """SIGSTOP of the prefill engine before the request's first token, then its registration goes (as its
    sidecar does when the engine stops answering): the engine does not answer the gateway's probe either, so
    the request goes to the other prefill engine at once, not after the first-token timeout. (An engine that
    leaves the registry but answers keeps its requests: tests/integration/test_gateway_late_binding.py.)"""
    registry, ns = cluster
    other = SimEngine(tmp_path, "prefill", MODEL, 0.2)
    wait_for_port("127.0.0.1", other.port, 30, other.proc.proc)
    hung = engines["prefill"].proc.proc.pid
    regs = await register(registry, engines["prefill"].info("p0"), engines["decode"].info("d0"))
    os.kill(hung, signal.SIGSTOP)
    try:
        async with gateway(nats_server, etcd_server, ns, first_token_timeout_s=120) as (url, service):
            await wait_instances(service, 2)
            async with httpx.AsyncClient(timeout=60) as client:
                t0 = time.monotonic()
                request = asyncio.create_task(client.post(url + "/v1/completions", json={**BODY, "stream": True}))
                assert (await first_attempt(service)).prefill.instance_id == "p0"  # type: ignore[union-attr]
                await register(registry, other.info("p1"))
                await regs[0].deregister()
                r = await request
                elapsed = time.monotonic() - t0
        assert r.status_code == 200 and streamed_tokens(r.text) == BODY["max_tokens"]
        assert counted(service, "poise_gateway_retries_total") == 1  # type: ignore[attr-defined]
        assert elapsed < 20  # the registry's change, not the 120-s first-token timeout
    finally:
        os.kill(hung, signal.SIGCONT)
        other.proc.stop()


@pytest.mark.parametrize(("hang", "resume"), [(signal.SIGSTOP, signal.SIGCONT), (signal.SIGUSR1, signal.SIGUSR2)],
                         ids=["process-stopped", "scheduler-hung"])
async def test_a_request_waiting_on_a_hung_engine_that_stays_registered_is_tried_on_another_pair(  # type: ignore[no-untyped-def]
        cluster, engines, nats_server, etcd_server, tmp_path, hang, resume) -> None:
    """The prefill engine hangs before the request's first token, its registration kept (its sidecar has not
    noticed yet): the whole process stopped (SIGSTOP), or only its scheduler, its HTTP server still answering
    (SIGUSR1: engine_sim's /health then waits for a step that never ends, as SGLang's one-token health check
    does). After stall_timeout_s of waiting the gateway asks the engine's /health, gets no 200 in
    probe_timeout_s, and tries the request on the other prefill engine, long before the first-token timeout."""
    registry, ns = cluster
    other = SimEngine(tmp_path, "prefill", MODEL, 0.2)
    wait_for_port("127.0.0.1", other.port, 30, other.proc.proc)
    hung = engines["prefill"].proc.proc.pid
    await register(registry, engines["prefill"].info("p0"), engines["decode"].info("d0"))
    os.kill(hung, hang)
    try:
        async with gateway(nats_server, etcd_server, ns, first_token_timeout_s=120, stall_timeout_s=1.0,
                           probe_timeout_s=1.0) as (url, service):
            await wait_instances(service, 2)
            async with httpx.AsyncClient(timeout=60) as client:
                t0 = time.monotonic()
                request = asyncio.create_task(client.post(url + "/v1/completions", json={**BODY, "stream": True}))
                assert (await first_attempt(service)).prefill.instance_id == "p0"  # type: ignore[union-attr]
                await register(registry, other.info("p1"))
                await wait_instances(service, 3)
                r = await request
                elapsed = time.monotonic() - t0
        assert r.status_code == 200 and streamed_tokens(r.text) == BODY["max_tokens"]
        assert counted(service, "poise_gateway_retries_total") == 1  # type: ignore[attr-defined]
        assert "p0" in service.cluster.instances  # it never left the registry
        assert elapsed < 20  # stall_timeout_s and a probe, not the 120-s first-token timeout
    finally:
        os.kill(hung, resume)
        other.proc.stop()
