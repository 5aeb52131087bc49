"""Moving running requests between decode engines without the client noticing, against real NATS, etcd and
engine_sim processes (one prefill, two decode).

- Moves ordered over NATS (the migrator's MoveCommand) during a burst of streams, by re-prefill
  (``recompute``) and by engine_sim's KV copy (``kv-transfer``): every stream's text, finish reason and usage
  must equal those of the same requests run without moves, byte for byte (engine_sim's tokens are a pure
  function of the prompt and the position, whichever engine produces them).
- A move to a target that fails leaves the request on its source, intact.
- A decode engine killed mid-answer (during a burst of streams, and during a trace replay): its requests are
  resumed on the other one, nothing lost.
- A replay of an Azure conversation trace slice with moves forced every 0.2 s (random requests, both
  mechanisms): again byte for byte against the same replay without moves.
- Non-streaming requests (gateway ``move_non_streaming``): moved mid-answer, and rescued from a killed
  decode engine, their JSON bodies equal those of the same requests run without moves.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import msgspec
import orjson
import pytest
import pytest_asyncio

from loadgen.replay import build_request_body
from loadgen.traces import load_trace
from services.gateway.service import GatewayService
from services.migrator.config import MigratorSettings
from services.migrator.service import MigratorService
from shared.bus import Bus
from shared.devservers import EtcdServer, NatsServer
from shared.protocol import AdminCommand, AdminReply, Subjects
from shared.protocol.length_prediction import PREDICTION_FIELD
from shared.protocol.moves import GatewayRequests, GatewayRequestsQuery, MoveCommand, MoveReply
from shared.registry import Registry
from shared.settings import load_settings
from tests.integration.gateway_harness import (
    SimEngine,
    counted,
    engine_info,
    fresh_registry,
    register,
    run_gateway,
    serving,
)
from tests.integration.waiting import until

MODEL = "mig-model"
pytestmark = pytest.mark.asyncio
# time_scale 4: a decode step of the 8B/H100 profile takes ~40 ms, so a 150-token answer streams for ~6 s,
# long enough to move it mid-answer.
TIME_SCALE = 4.0
N_REQUESTS = 6


def bodies() -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    for i in range(N_REQUESTS):
        if i % 2:
            out.append({"model": MODEL, "messages": [{"role": "user", "content": f"question {i} " * 20}],
                        "max_tokens": 150, "stream": True, "stream_options": {"include_usage": True}})
        else:
            out.append({"model": MODEL, "prompt": f"prompt number {i} " * 30, "max_tokens": 150,
                        "ignore_eos": i == 0, "stream": True, "stream_options": {"include_usage": True}})
    return out


@dataclass
class Stream:
    text: str = ""
    finish: str | None = None
    usage: dict[str, Any] | None = None
    rid: str | None = None
    tokens: int = 0
    errors: list[str] = field(default_factory=list)


async def stream(client: httpx.AsyncClient, url: str, body: dict[str, Any], into: Stream) -> Stream:
    path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
    async with client.stream("POST", url + path, json=body) as r:
        assert r.status_code == 200, await r.aread()
        into.rid = r.headers.get("x-request-id")
        async for line in r.aiter_lines():
            if not line.startswith("data:") or line == "data: [DONE]":
                continue
            chunk = orjson.loads(line[5:])
            assert PREDICTION_FIELD not in chunk  # the engines' predictions are the gateway's, not the client's
            if "error" in chunk:
                into.errors.append(str(chunk["error"]))
                continue
            if chunk.get("usage") and not chunk.get("choices"):
                into.usage = chunk["usage"]
            for choice in chunk.get("choices") or []:
                piece = (choice.get("delta") or {}).get("content") if "delta" in choice else choice.get("text")
                if piece:
                    into.text += piece
                    into.tokens += 1
                into.finish = choice.get("finish_reason") or into.finish
    return into


@pytest.fixture(scope="module")
def engines(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, SimEngine]]:
    tmp = tmp_path_factory.mktemp("mig-engines")
    oracle = ("--length-predictor", "oracle")  # remaining-length predictions on the stream: the truth
    started = {"p0": SimEngine(tmp, "prefill", MODEL, TIME_SCALE, bootstrap_timeout_s=10),
               "d0": SimEngine(tmp, "decode", MODEL, TIME_SCALE, bootstrap_timeout_s=10, extra_args=oracle),
               "d1": SimEngine(tmp, "decode", MODEL, TIME_SCALE, bootstrap_timeout_s=10, extra_args=oracle)}
    yield from serving(started)


@pytest.fixture
def own_engines(tmp_path: Path) -> Iterator[dict[str, SimEngine]]:
    """p0, d0 and d1 of one test alone: it kills one of them."""
    yield from serving({"p0": SimEngine(tmp_path, "prefill", MODEL, TIME_SCALE, bootstrap_timeout_s=10),
                        "d0": SimEngine(tmp_path, "decode", MODEL, TIME_SCALE, bootstrap_timeout_s=10),
                        "d1": SimEngine(tmp_path, "decode", MODEL, TIME_SCALE, bootstrap_timeout_s=10)})


@pytest_asyncio.fixture
async def registry(etcd_server: EtcdServer) -> AsyncIterator[Registry]:
    async with fresh_registry(etcd_server) as reg:
        yield reg


async def answer(client: httpx.AsyncClient, url: str, body: dict[str, Any], into: Stream) -> Stream:
    """A non-streaming request: the whole JSON body, read into the fields a stream fills."""
    path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
    r = await client.post(url + path, json=body)
    assert r.status_code == 200, r.text
    data = r.json()
    choice = data["choices"][0]
    into.text = choice["message"]["content"] if "message" in choice else choice["text"]
    into.finish, into.usage, into.rid = choice["finish_reason"], data["usage"], data["id"]
    return into


def whole(body: dict[str, Any]) -> dict[str, Any]:
    out = dict(body, stream=False)
    out.pop("stream_options", None)
    return out


@contextlib.asynccontextmanager
async def gateway(nats_server: NatsServer, etcd_server: EtcdServer, registry: Registry,
                  engines: dict[str, SimEngine], *extra: Any, **overrides: Any) -> AsyncIterator[tuple[str, GatewayService]]:
    ns = registry.keys.namespace
    await register(registry, *(e.info(name) for name, e in engines.items()), *extra)
    async with run_gateway(nats_server, etcd_server, ns, first_token_timeout_s=15,
                           dispatch_policy="round-robin", **overrides) as (url, service):
        await until(lambda: len(service.cluster.instances) == len(engines) + len(extra), 10)
        yield url, service


async def reference(url: str) -> list[Stream]:
    async with httpx.AsyncClient(timeout=60) as client:
        return list(await asyncio.gather(*(stream(client, url, b, Stream()) for b in bodies())))


def assert_same(got: list[Stream], want: list[Stream]) -> None:
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        assert not g.errors, (i, g.errors)
        assert g.text == w.text, f"request {i}: text differs after the move"
        assert g.finish == w.finish, i
        assert g.usage is not None and w.usage is not None
        assert g.usage["completion_tokens"] == w.usage["completion_tokens"], i
        assert g.usage["prompt_tokens"] == w.usage["prompt_tokens"], i


async def test_moves_over_nats_keep_every_stream_byte_for_byte(nats_server, etcd_server, registry, engines) -> None:  # type: ignore[no-untyped-def]
    async with gateway(nats_server, etcd_server, registry, engines) as (url, service):
        want = await reference(url)
        assert all(w.tokens > 20 for w in want)
        bus = Bus(nats_server.url, name="test-migrator")
        await bus.connect()
        subjects = Subjects(registry.keys.namespace)
        try:
            got = [Stream() for _ in range(N_REQUESTS)]
            async with httpx.AsyncClient(timeout=60) as client:
                tasks = [asyncio.create_task(stream(client, url, b, s)) for b, s in zip(bodies(), got, strict=True)]
                await until(lambda: all(s.tokens >= 10 for s in got), 20)
                tables = await bus.gather(subjects.gateway_requests(), GatewayRequestsQuery(), GatewayRequests,
                                          timeout_s=0.3)
                assert len(tables) == 1 and tables[0].gateway == service.move_token
                table = {r.rid: r for r in tables[0].requests}
                assert set(table) == {s.rid for s in got}
                assert all(r.generated_tokens >= 10 for r in table.values())
                # The decode engines' predictions (oracle: the truth) reach the table, decremented per token.
                ruler = table[got[0].rid or ""]  # ignore_eos: exactly max_tokens tokens
                assert ruler.predicted_remaining_tokens == 150 - ruler.generated_tokens
                assert all(r.predicted_remaining_tokens is not None for r in table.values())
                subject = subjects.gateway_move(tables[0].gateway)
                replies = await asyncio.gather(*(
                    bus.request(subject, MoveCommand(
                        rid=rid, target_id="d1" if info.instance_id == "d0" else "d0",
                        mechanism="kv-transfer" if i % 2 else "recompute"), MoveReply, timeout_s=30)
                    for i, (rid, info) in enumerate(sorted(table.items()))))
                await asyncio.gather(*tasks)
        finally:
            await bus.close()
        assert all(r.ok for r in replies), [r.message for r in replies]
        assert {r.mechanism for r in replies} == {"recompute", "kv-transfer"}
        assert all(r.stall_s is not None and r.stall_s < 5 for r in replies)
        assert_same(got, want)
        assert sum(counted(service, "poise_gateway_migrations_total", mechanism=m)
                   for m in ("recompute", "kv-transfer")) == N_REQUESTS


async def test_a_failed_move_leaves_the_request_on_its_source(nats_server, etcd_server, registry, engines) -> None:  # type: ignore[no-untyped-def]
    dead = engine_info("dead", "decode", "http://127.0.0.1:9", None, MODEL)  # nothing listens on port 9
    async with gateway(nats_server, etcd_server, registry, engines, dead) as (url, service):
        want = await reference(url)
        got = Stream()
        async with httpx.AsyncClient(timeout=60) as client:
            task = asyncio.create_task(stream(client, url, bodies()[0], got))
            await until(lambda: got.tokens >= 10, 20)
            assert got.rid is not None
            unknown = await service.move(got.rid, "nope", "recompute")
            assert not unknown.ok and "not a registered decode instance" in unknown.message
            failed = await service.move(got.rid, "dead", "recompute")
            assert not failed.ok and "stays where it was" in failed.message
            await task
        assert_same([got], want[:1])


async def test_poise_admin_migrate_goes_through_the_migrator(nats_server, etcd_server, registry, engines) -> None:  # type: ignore[no-untyped-def]
    async with gateway(nats_server, etcd_server, registry, engines) as (url, service):
        want = await reference(url)
        migrator = MigratorService(load_settings(
            MigratorSettings, nats_url=nats_server.url, etcd_url=etcd_server.url,
            namespace=registry.keys.namespace, leader_ttl_s=2))
        bus = Bus(nats_server.url, name="test-admin")
        await bus.connect()
        got = Stream()
        try:
            async with migrator, httpx.AsyncClient(timeout=60) as client:
                task = asyncio.create_task(stream(client, url, bodies()[1], got))
                await until(lambda: got.tokens >= 10, 20)
                source = service.flows[got.rid or ""].attempt.decode.instance_id  # type: ignore[union-attr]
                target = "d1" if source == "d0" else "d0"
                reply = await bus.request(
                    Subjects(registry.keys.namespace).admin("migrator"),
                    AdminCommand(verb="migrate", args={"rid": got.rid or "", "to": target, "mechanism": "kv-transfer"}),
                    AdminReply, timeout_s=30)
                await task
        finally:
            await bus.close()
        assert reply.ok, reply.message
        assert f"{source} -> {target} by kv-transfer" in reply.message
        assert reply.status is not None and reply.status.details["moved_total"] == 1
        assert_same([got], want[1:2])


async def test_a_decode_engine_killed_mid_answer_loses_no_request(nats_server, etcd_server, registry,  # type: ignore[no-untyped-def]
                                                                  own_engines) -> None:
    async with gateway(nats_server, etcd_server, registry, own_engines) as (url, service):
        want = await reference(url)
        got = [Stream() for _ in range(N_REQUESTS)]
        async with httpx.AsyncClient(timeout=60) as client:
            tasks = [asyncio.create_task(stream(client, url, b, s)) for b, s in zip(bodies(), got, strict=True)]
            await until(lambda: all(s.tokens >= 10 for s in got), 20)
            on_d0 = sum(1 for f in service.flows.values() if f.attempt and f.attempt.decode.instance_id == "d0")
            assert on_d0 > 0
            own_engines["d0"].proc.proc.kill()  # SIGKILL: no goodbye, the streams just break
            await asyncio.gather(*tasks)
        assert_same(got, want)
        assert counted(service, "poise_gateway_rescues_total") == on_d0  # type: ignore[attr-defined]


async def test_non_streaming_requests_move_and_survive_a_killed_engine(nats_server, etcd_server, registry,  # type: ignore[no-untyped-def]
                                                                      own_engines) -> None:
    requests = [whole(b) for b in bodies()]

    async def run(url: str) -> tuple[list[Stream], list[asyncio.Task[Stream]], httpx.AsyncClient]:
        client = httpx.AsyncClient(timeout=60)
        got = [Stream() for _ in requests]
        return got, [asyncio.create_task(answer(client, url, b, s)) for b, s in zip(requests, got, strict=True)], client

    async with gateway(nats_server, etcd_server, registry, own_engines, move_non_streaming=True) as (url, service):
        async with httpx.AsyncClient(timeout=60) as client:
            want = list(await asyncio.gather(*(answer(client, url, b, Stream()) for b in requests)))
        assert all(w.usage and w.usage["completion_tokens"] > 20 for w in want)
        # Moved mid-answer, by both mechanisms: the client's body does not change.
        got, tasks, client = await run(url)
        async with client:
            await until(lambda: len(service.movable_requests()) == len(requests)
                        and all(r.generated_tokens >= 10 for r in service.movable_requests()), 20)
            moves = await asyncio.gather(*(
                service.move(r.rid, "d1" if r.instance_id == "d0" else "d0", ("recompute", "kv-transfer")[i % 2])
                for i, r in enumerate(service.movable_requests())))
            await asyncio.gather(*tasks)
        assert all(m.ok for m in moves), [m.message for m in moves]
        assert_same(got, want)
        # A decode engine killed mid-answer: its requests resume elsewhere from the tokens they had.
        got, tasks, client = await run(url)
        async with client:
            await until(lambda: len(service.movable_requests()) == len(requests)
                        and all(r.generated_tokens >= 10 for r in service.movable_requests()), 20)
            on_d0 = sum(1 for r in service.movable_requests() if r.instance_id == "d0")
            assert on_d0 > 0
            own_engines["d0"].proc.proc.kill()
            await asyncio.gather(*tasks)
        assert_same(got, want)
        assert counted(service, "poise_gateway_rescues_total") == on_d0  # type: ignore[attr-defined]


def replay_slice() -> list[tuple[float, dict[str, Any]]]:
    """(arrival s, body) for 24 Azure conversation requests, arrivals squeezed into ~3 s, outputs of 60-200."""
    requests = load_trace("azure-conv").requests[:24]
    t0 = requests[0].arrival_s
    span = max(requests[-1].arrival_s - t0, 1e-9)
    out = []
    for r in requests:
        clipped = msgspec.structs.replace(r, output_tokens=min(max(r.output_tokens, 60), 200))
        body = orjson.loads(build_request_body(clipped, model=MODEL, endpoint="completions"))
        out.append(((r.arrival_s - t0) / span * 3.0, body))
    return out


async def replay(url: str, items: list[tuple[float, dict[str, Any]]], got: list[Stream]) -> None:
    async with httpx.AsyncClient(timeout=90) as client:
        start = time.monotonic()

        async def one(at: float, body: dict[str, Any], into: Stream) -> None:
            await asyncio.sleep(max(0.0, start + at - time.monotonic()))
            await stream(client, url, body, into)

        await asyncio.gather(*(one(at, b, s) for (at, b), s in zip(items, got, strict=True)))


async def test_a_decode_engine_killed_during_a_trace_replay_loses_no_request(nats_server, etcd_server, registry,  # type: ignore[no-untyped-def]
                                                                         own_engines) -> None:
    items = replay_slice()
    async with gateway(nats_server, etcd_server, registry, own_engines) as (url, service):
        want = [Stream() for _ in items]
        await replay(url, items, want)
        got = [Stream() for _ in items]
        task = asyncio.create_task(replay(url, items, got))
        # Mid-replay: some answers under way on d0, later arrivals not sent yet. d0 stays registered (its
        # lease outlives it), so those later requests are placed on it too and must be retried elsewhere.
        await until(lambda: sum(1 for f in service.flows.values() if f.attempt is not None
                                and f.attempt.decode.instance_id == "d0" and f.delivered_tokens >= 5) >= 3, 20)
        own_engines["d0"].proc.proc.kill()
        await task
    assert_same(got, want)
    assert counted(service, "poise_gateway_rescues_total") >= 3  # type: ignore[attr-defined]


async def test_moves_forced_during_a_trace_replay_change_no_byte(nats_server, etcd_server, registry, engines) -> None:  # type: ignore[no-untyped-def]
    items = replay_slice()
    async with gateway(nats_server, etcd_server, registry, engines) as (url, service):
        want = [Stream() for _ in items]
        await replay(url, items, want)
        got = [Stream() for _ in items]
        task = asyncio.create_task(replay(url, items, got))
        rng = random.Random(7)
        moves: list[Any] = []
        while not task.done():
            candidates = service.movable_requests()
            if candidates:
                pick = rng.choice(candidates)
                moves.append(await service.move(pick.rid, "d1" if pick.instance_id == "d0" else "d0",
                                                rng.choice(["recompute", "kv-transfer"])))
            await asyncio.sleep(0.2)
        await task
    ok = [m for m in moves if m.ok]
    assert len(ok) >= 10, [m.message for m in moves]
    assert {m.mechanism for m in ok} == {"recompute", "kv-transfer"}
    assert_same(got, want)
