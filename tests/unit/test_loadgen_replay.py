"""Replay client against a real (tiny) streaming HTTP server on a loopback port.

The server below speaks just enough HTTP/1.1 (keep-alive, chunked SSE) and the
OpenAI streaming format to exercise every path of `loadgen.replay`: normal
streams, an HTTP 400 with an OpenAI error body, an in-stream error, a hung
request, missing usage, and a short response.
"""

from __future__ import annotations

import asyncio
import io
import json
import socket
from typing import Any

import msgspec
import pytest

from loadgen.progress import ReplayProgress, format_progress, print_progress
from loadgen.prompts import LOWEST_TOKEN_ID, prompt_text, prompt_token_ids
from loadgen.replay import build_request_body, endpoint_url, replay
from loadgen.slo import SLO
from loadgen.sse import StreamAccumulator
from loadgen.workload import TraceRequest, Workload

MAX_CONTEXT = 1000  # prompts longer than this get HTTP 400
STREAM_ERROR_TOKENS = 13  # max_tokens that triggers an in-stream error after 2 tokens
HANG_TOKENS = 99  # max_tokens that makes the server stall
SLO_LOOSE = SLO(ttft_s=5.0, tpot_s=1.0)


class SSEServer:
    """Minimal OpenAI-style streaming server (asyncio streams, HTTP/1.1 keep-alive)."""

    def __init__(self, *, token_delay_s: float = 0.002, usage: bool = True, short_by: int = 0) -> None:
        self.token_delay_s = token_delay_s
        self.usage = usage
        self.short_by = short_by
        self.refusals: dict[int, list[int]] = {}  # max_tokens -> statuses to refuse it with, in turn, first
        self.bodies: list[dict[str, Any]] = []
        self.headers: list[dict[str, str]] = []
        self.active = 0
        self.max_active = 0
        self._writers: set[asyncio.StreamWriter] = set()
        self._server: asyncio.Server | None = None
        self.port = 0

    async def __aenter__(self) -> SSEServer:
        self._server = await asyncio.start_server(self._handle, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self._server is not None
        self._server.close()
        for writer in list(self._writers):
            writer.close()
        await self._server.wait_closed()

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._writers.add(writer)
        try:
            while True:
                request_line = await reader.readline()
                if not request_line:
                    return
                _method, path, _version = request_line.decode().split(" ", 2)
                headers: dict[str, str] = {}
                while (line := await reader.readline()) not in (b"\r\n", b"\n", b""):
                    key, value = line.decode().split(":", 1)
                    headers[key.strip().lower()] = value.strip()
                body = await reader.readexactly(int(headers.get("content-length", "0")))
                await self._respond(writer, path, headers, json.loads(body))
        except (ConnectionError, asyncio.IncompleteReadError):
            return
        finally:
            self._writers.discard(writer)
            writer.close()

    async def _respond(
        self, writer: asyncio.StreamWriter, path: str, headers: dict[str, str], body: dict[str, Any]
    ) -> None:
        self.bodies.append(body)
        self.headers.append(headers)
        chat = path == "/v1/chat/completions"
        if path not in ("/v1/completions", "/v1/chat/completions"):
            return await self._plain(writer, 404, {"error": {"message": f"no route {path}"}})
        if not chat and len(body["prompt"]) > MAX_CONTEXT:
            message = f"This model's maximum context length is {MAX_CONTEXT} tokens."
            error = {"message": message, "type": "invalid_request_error", "param": None, "code": 400}
            return await self._plain(writer, 400, {"error": error})
        max_tokens = body["max_tokens"]
        if self.refusals.get(max_tokens):
            status = self.refusals[max_tokens].pop(0)
            extra = "Retry-After: 0.05\r\n" if status == 429 else ""
            return await self._plain(writer, status, {"error": {"message": "busy", "code": status}}, extra)
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n")
        self.active += 1
        self.max_active = max(self.max_active, self.active)
        try:
            if chat:  # a role-only first chunk, which must not count as a token
                await self._event(writer, {"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]})
            if max_tokens == HANG_TOKENS:
                await asyncio.sleep(10)
            n = max_tokens - self.short_by
            for i in range(n):
                await asyncio.sleep(self.token_delay_s)
                if max_tokens == STREAM_ERROR_TOKENS and i == 2:
                    await self._event(writer, {"error": {"message": "engine died", "code": 500}})
                    break
                choice = {"index": 0, "delta": {"content": f"t{i}"}} if chat else {"index": 0, "text": f" t{i}"}
                await self._event(writer, {"choices": [choice]})
            if self.usage and max_tokens != STREAM_ERROR_TOKENS:
                usage = {"prompt_tokens": 1, "completion_tokens": n, "total_tokens": n + 1}
                await self._event(writer, {"choices": [], "usage": usage})
            await self._chunk(writer, b"data: [DONE]\n\n")
            await self._chunk(writer, b"")
        finally:
            self.active -= 1

    async def _event(self, writer: asyncio.StreamWriter, payload: dict[str, Any]) -> None:
        await self._chunk(writer, b"data: " + json.dumps(payload).encode() + b"\n\n")

    @staticmethod
    async def _chunk(writer: asyncio.StreamWriter, data: bytes) -> None:
        writer.write(b"%x\r\n%s\r\n" % (len(data), data))
        await writer.drain()

    @staticmethod
    async def _plain(writer: asyncio.StreamWriter, status: int, payload: dict[str, Any], extra: str = "") -> None:
        data = json.dumps(payload).encode()
        head = (f"HTTP/1.1 {status} Error\r\nContent-Type: application/json\r\nContent-Length: {len(data)}\r\n"
                f"{extra}\r\n")
        writer.write(head.encode() + data)
        await writer.drain()


def _workload(specs: list[tuple[float, int, int]], hash_ids: bool = False) -> Workload:
    requests = [
        TraceRequest(
            index=i,
            arrival_s=arrival,
            input_tokens=inp,
            output_tokens=out,
            hash_ids=tuple(range(-(-inp // 512))) if hash_ids else (),
        )
        for i, (arrival, inp, out) in enumerate(specs)
    ]
    return Workload(name="test", requests=requests)


@pytest.mark.asyncio
async def test_replay_completions_records_successes_and_http_error() -> None:
    specs = [(0.0, 10, 5), (0.02, 600, 8), (0.04, 1200, 4), (0.06, 30, 1), (0.08, 40, 12), (0.1, 50, 3)]
    workload = _workload(specs, hash_ids=True)
    async with SSEServer() as server:
        result = await replay(workload, server.base_url, model="m", slo=SLO_LOOSE, api_key="sk-test")
    records = result.records
    assert [r.index for r in records] == list(range(len(specs)))
    bad = records[2]
    assert bad.status == "error" and bad.http_status == 400
    assert bad.error is not None and "maximum context length is 1000 tokens" in bad.error
    assert bad.first_token_s is None and bad.output_tokens_received == 0
    for r in records[:2] + records[3:]:
        assert r.status == "ok", r.error
        assert r.http_status == 200 and r.error is None
        assert r.output_tokens_received == r.output_tokens_expected
        assert len(r.token_times_s) == r.output_tokens_expected
        assert r.first_token_s is not None and r.sent_s < r.first_token_s <= r.finished_s
        assert r.token_times_s == sorted(r.token_times_s) and r.token_times_s[0] == r.first_token_s
        assert r.sent_s >= r.arrival_s - 1e-3
        assert r.ttft_s is not None and 0 < r.ttft_s < 1
    assert records[3].tpot_s == 0.0  # a single token has no decode interval
    assert result.summary.requests_total == 6
    assert result.summary.requests_ok == 5 and result.summary.requests_failed == 1
    assert result.summary.slo_attainment == pytest.approx(5 / 6)
    assert result.summary.token_mismatches == 0
    assert result.wall_s >= max(r.finished_s for r in records)
    # Exactly the trace's lengths went over the wire, with the documented body.
    bodies = sorted(server.bodies, key=lambda b: len(b["prompt"]))
    assert [len(b["prompt"]) for b in bodies] == sorted(s[1] for s in specs)
    for body in bodies:
        assert body["model"] == "m" and body["stream"] is True and body["ignore_eos"] is True
        assert body["stream_options"] == {"include_usage": True} and body["temperature"] == 0
    assert {b["max_tokens"] for b in bodies} == {s[2] for s in specs}
    assert all(h["authorization"] == "Bearer sk-test" for h in server.headers)
    assert len({h["x-request-id"] for h in server.headers}) == len(specs)
    # Shared leading hash ids => identical leading 512-token blocks.
    long_prompt = next(b["prompt"] for b in bodies if len(b["prompt"]) == 600)
    short_prompt = next(b["prompt"] for b in bodies if len(b["prompt"]) == 10)
    assert long_prompt[:10] == short_prompt


@pytest.mark.asyncio
async def test_replay_chat_without_usage_counts_content_chunks() -> None:
    workload = _workload([(0.0, 20, 4), (0.01, 20, 6)])
    async with SSEServer(usage=False) as server:
        result = await replay(workload, server.base_url + "/v1/", model="m", endpoint="chat", slo=SLO_LOOSE)
    assert [r.status for r in result.records] == ["ok", "ok"]
    assert [r.output_tokens_received for r in result.records] == [4, 6]
    assert all("messages" in b and "prompt" not in b for b in server.bodies)
    assert result.config["url"].endswith("/v1/chat/completions")


@pytest.mark.asyncio
async def test_replay_stream_error_timeout_short_response_and_dropped_token_times() -> None:
    workload = _workload([(0.0, 10, 5), (0.0, 10, STREAM_ERROR_TOKENS), (0.0, 10, HANG_TOKENS)])
    async with SSEServer(short_by=1) as server:
        result = await replay(
            workload, server.base_url, model="m", slo=SLO_LOOSE, timeout_s=0.5, keep_token_times=False
        )
    short, stream_error, hung = result.records
    assert short.status == "ok" and short.output_tokens_received == 4 and short.token_times_s == []
    assert stream_error.status == "error" and stream_error.error is not None and "engine died" in stream_error.error
    assert stream_error.output_tokens_received == 2 and stream_error.http_status == 200
    assert hung.status == "error" and hung.error is not None and hung.error.startswith("timeout")
    assert 0.45 <= hung.e2e_s < 2.0
    assert result.summary.token_mismatches == 1
    assert result.summary.requests_failed == 2


@pytest.mark.asyncio
async def test_replay_unreachable_server_records_errors() -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    result = await replay(_workload([(0.0, 5, 2), (0.01, 5, 2)]), f"http://127.0.0.1:{port}", model="m", slo=SLO_LOOSE)
    assert [r.status for r in result.records] == ["error", "error"]
    assert all(r.http_status is None and r.error for r in result.records)
    assert result.summary.slo_attainment == 0.0 and result.summary.ttft_p50_s is None


@pytest.mark.asyncio
async def test_replay_rate_scale_concurrency_limit_and_progress() -> None:
    workload = _workload([(i * 0.04, 10, 10) for i in range(10)])
    seen: list[ReplayProgress] = []
    async with SSEServer(token_delay_s=0.01) as server:
        result = await replay(
            workload,
            server.base_url,
            model="m",
            slo=SLO_LOOSE,
            rate_scale=2.0,
            concurrency_limit=2,
            progress=seen.append,
            progress_interval_s=0.05,
        )
    assert server.max_active <= 2
    assert [r.arrival_s for r in result.records] == pytest.approx([i * 0.02 for i in range(10)])
    assert result.summary.requests_ok == 10
    assert max(r.lateness_s for r in result.records) > 0.05  # the limit made later sends late
    assert len(seen) >= 2 and seen[-1].final and seen[-1].done == 10 and seen[-1].in_flight == 0
    assert all(not p.final for p in seen[:-1])


@pytest.mark.asyncio
async def test_replay_sends_on_schedule() -> None:
    workload = _workload([(0.0, 5, 2), (0.1, 5, 2), (0.2, 5, 2)])
    async with SSEServer() as server:
        result = await replay(workload, server.base_url, model="m", slo=SLO_LOOSE)
    for r in result.records:
        assert r.arrival_s - 1e-3 <= r.sent_s <= r.arrival_s + 0.05


class _Tty(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_print_progress_rewrites_one_line_on_a_terminal() -> None:
    p = ReplayProgress(total=10, sent=5, done=3, failed=1, in_flight=2, elapsed_s=1.5, ttft_p50_s=0.0123)
    out = _Tty()
    print_progress(p, out)
    print_progress(msgspec.structs.replace(p, final=True), out)
    text = out.getvalue()
    assert text.startswith("\r") and text.endswith("\n") and text.count("\n") == 1
    assert "sent 5/10" in format_progress(p) and "12ms" in format_progress(p)


def test_print_progress_writes_sparse_lines_to_a_log() -> None:
    out = io.StringIO()
    for second in range(25):
        p = ReplayProgress(total=10, sent=5, done=3, failed=0, in_flight=2, elapsed_s=second + 0.01, ttft_p50_s=None)
        print_progress(p, out)
    print_progress(msgspec.structs.replace(p, final=True), out)
    lines = out.getvalue().splitlines()
    assert "\r" not in out.getvalue()
    assert [line.split("]")[0].strip("[ ") for line in lines] == ["0.0s", "10.0s", "20.0s", "24.0s"]


def test_prompt_token_ids_deterministic_and_prefix_sharing() -> None:
    a = prompt_token_ids(0, 1500, (7, 8, 9))
    assert len(a) == 1500 and a == prompt_token_ids(0, 1500, (7, 8, 9))
    assert all(LOWEST_TOKEN_ID <= t < 32000 for t in a)
    b = prompt_token_ids(1, 1100, (7, 8, 5))  # same first two blocks, different third
    assert a[:1024] == b[:1024] and a[1024:1100] != b[1024:1100]
    c = prompt_token_ids(2, 700, (7,))  # tail beyond hash coverage is request-specific
    assert c[:512] == a[:512] and c[512:] != a[512:700]
    assert prompt_token_ids(3, 100) != prompt_token_ids(4, 100)
    assert prompt_token_ids(5, 0) == []
    assert max(prompt_token_ids(6, 2000, vocab_size=1000)) < 1000
    text = prompt_text(0, 100)
    assert 350 <= len(text) <= 450  # ~4 chars per token


def test_build_request_body_and_url() -> None:
    req = TraceRequest(index=3, arrival_s=0.0, input_tokens=17, output_tokens=9)
    body = json.loads(build_request_body(req, model="x", endpoint="completions"))
    assert len(body["prompt"]) == 17 and body["max_tokens"] == 9 and body["ignore_eos"] is True
    assert endpoint_url("http://h:1", "completions") == "http://h:1/v1/completions"
    assert endpoint_url("http://h:1/v1/", "chat") == "http://h:1/v1/chat/completions"
    with pytest.raises(ValueError):
        endpoint_url("http://h:1", "embeddings")  # type: ignore[arg-type]


def test_stream_accumulator_prefers_usage_and_ignores_noise() -> None:
    acc = StreamAccumulator()
    lines = [
        ": keep-alive",
        "",
        'data: {"choices":[{"index":0,"text":""}]}',
        'data: {"choices":[{"index":0,"text":"a"}]}',
        "event: message",
        'data:{"choices":[{"index":0,"text":"bc"}]}',
        'data: {"choices":[],"usage":{"completion_tokens":3}}',
    ]
    for i, line in enumerate(lines):
        assert acc.feed_line(line, float(i)) is False
    assert acc.feed_line("data: [DONE]", 9.0) is True
    assert acc.content_chunks == 2 and acc.tokens_received == 3
    assert acc.first_token_s == 3.0 and acc.token_times_s == [3.0, 5.0]
    with pytest.raises(ValueError, match="malformed"):
        StreamAccumulator().feed_line("data: {not json", 0.0)


@pytest.mark.asyncio
async def test_a_refused_request_is_sent_again_as_the_openai_client_does() -> None:
    """429 (Retry-After 0.05 s) then 503 (no header: 0.5 s backoff) then served: one record, three sends, its
    times from the first send; refused three times it is a miss; without retries the first refusal stands."""
    work = _workload([(0.0, 10, 5), (0.0, 10, 6), (0.0, 10, 7)])
    async with SSEServer() as server:
        server.refusals = {5: [429, 503], 6: [429, 429, 429], 7: []}
        result = await replay(work, server.base_url, model="m", slo=SLO_LOOSE, client_retries=2)
        server.refusals = {5: [429]}
        once = await replay(_workload([(0.0, 10, 5)]), server.base_url, model="m", slo=SLO_LOOSE)
    served, refused, plain = sorted(result.records, key=lambda r: r.index)
    assert served.ok and served.attempts == 3 and served.output_tokens_received == 5
    assert served.ttft_s is not None and served.ttft_s >= 0.55  # 0.05 s + 0.5 s of waiting, from the first send
    assert not refused.ok and refused.attempts == 3 and refused.http_status == 429
    assert plain.ok and plain.attempts == 1
    assert result.summary.retries == 4 and result.summary.refused_share == pytest.approx(1 / 3)
    assert once.records[0].attempts == 1 and once.records[0].http_status == 429
    sends = sorted(int(h["x-stainless-retry-count"]) for b, h in zip(server.bodies, server.headers, strict=True)
                   if b["max_tokens"] == 6)
    assert sends == [0, 1, 2], "each send names the sends before it, as the openai client's header does"
