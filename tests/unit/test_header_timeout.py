"""The header-read timeout uvicorn lacks (shared/header_timeout.py), on a real uvicorn server on the loopback:
trickled headers get a 408 and a closed connection, an idle connection is closed without an answer, and
requests that send their headers in time, one after another on a keep-alive connection, are served."""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
from collections.abc import AsyncIterator

import pytest
import uvicorn

from shared.header_timeout import protocol_with_header_timeout
from tests.integration.waiting import until

TIMEOUT_S = 0.5


async def app(scope: dict, receive, send) -> None:  # type: ignore[no-untyped-def, type-arg]
    if scope["type"] != "http":
        return
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"2")]})
    await send({"type": "http.response.body", "body": b"ok"})


@contextlib.asynccontextmanager
async def server() -> AsyncIterator[int]:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    config = uvicorn.Config(app, log_level="warning", lifespan="off", http=protocol_with_header_timeout(TIMEOUT_S))
    srv = uvicorn.Server(config)
    task = asyncio.create_task(srv.serve(sockets=[sock]))
    try:
        await until(lambda: srv.started)
        yield port
    finally:
        srv.should_exit = True
        await asyncio.wait_for(task, 10)


async def read_all(reader: asyncio.StreamReader) -> bytes:
    async with asyncio.timeout(10):
        return await reader.read()  # until the server closes the connection


@pytest.mark.asyncio
async def test_trickled_headers_get_a_408_and_the_connection_closes() -> None:
    async with server() as port:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")  # and no more
        await writer.drain()
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        answer = await read_all(reader)
        assert loop.time() - t0 >= TIMEOUT_S * 0.9
        head, _, body = answer.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 408") and json.loads(body)["error"]["code"] == "request_timeout"
        writer.close()


@pytest.mark.asyncio
async def test_an_idle_connection_is_closed_without_an_answer() -> None:
    async with server() as port:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        assert await read_all(reader) == b""
        writer.close()


@pytest.mark.asyncio
async def test_requests_in_time_are_served_on_a_kept_alive_connection() -> None:
    async with server() as port:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        for _ in range(3):  # together they outlast the timeout; each sends its headers at once
            writer.write(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
            await writer.drain()
            async with asyncio.timeout(10):
                head = await reader.readuntil(b"\r\n\r\n")
                assert head.startswith(b"HTTP/1.1 200") and await reader.readexactly(2) == b"ok"
            await asyncio.sleep(TIMEOUT_S * 0.6)
        writer.close()
