"""The gateway's HTTP/1.1 client against a real socket server: framing, keep-alive, stale connections."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import AsyncIterator

import pytest
import pytest_asyncio

from shared.http1 import Http1Pool, split_url

pytestmark = pytest.mark.asyncio


class Server:
    """Answers each request with the next canned response; counts connections."""

    def __init__(self, responses: list[bytes]) -> None:
        self.responses = responses
        self.connections = 0
        self.targets: list[bytes] = []
        self.server: asyncio.Server | None = None
        self.close_after_each = False
        self.closed = asyncio.Event()  # set once the server has closed a connection

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                self.targets.append(head.split(b" ")[1])
                length = next((int(line.split(b":")[1]) for line in head.split(b"\r\n")
                               if line.lower().startswith(b"content-length")), 0)
                await reader.readexactly(length)
                writer.write(self.responses.pop(0))
                await writer.drain()
                if self.close_after_each:
                    break
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        writer.close()
        await writer.wait_closed()
        self.closed.set()

    @property
    def url(self) -> str:
        assert self.server is not None
        return f"http://127.0.0.1:{self.server.sockets[0].getsockname()[1]}"


@pytest_asyncio.fixture
async def server() -> AsyncIterator[Server]:
    s = Server([])
    s.server = await asyncio.start_server(s.handle, "127.0.0.1", 0)
    yield s
    s.server.close()


def _ok(body: bytes) -> bytes:
    return b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body)


async def test_content_length_and_keep_alive(server: Server) -> None:
    server.responses = [_ok(b'{"a": 1}'), _ok(b"second")]
    pool = Http1Pool()
    assert await pool.post_json(server.url + "/x", b"{}") == (200, b'{"a": 1}')
    assert await pool.fetch("GET", server.url + "/y?timeout_s=3") == (200, b"second")
    assert server.connections == 1 and server.targets == [b"/x", b"/y?timeout_s=3"]
    await pool.aclose()


async def test_chunked_stream_lines(server: Server) -> None:
    chunks = [b"data: one\n\n", b"data: tw", b"o\n\ndata: [DONE]\n\n"]
    body = b"".join(b"%x\r\n%s\r\n" % (len(c), c) for c in chunks) + b"0\r\n\r\n"
    server.responses = [b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n" + body, _ok(b"after")]
    pool = Http1Pool()
    response = await pool.request("POST", server.url + "/stream", b"{}")
    lines = [line async for line in response.aiter_lines() if line]
    response.close()
    assert lines == [b"data: one", b"data: two", b"data: [DONE]"]
    assert await pool.fetch("GET", server.url + "/") == (200, b"after")
    assert server.connections == 1  # the fully read stream gave its connection back
    await pool.aclose()


async def test_unread_body_drops_the_connection(server: Server) -> None:
    server.responses = [_ok(b"x" * 100), _ok(b"y")]
    pool = Http1Pool()
    response = await pool.request("GET", server.url + "/")
    response.close()  # body not read: the connection cannot be reused
    assert await pool.fetch("GET", server.url + "/") == (200, b"y")
    assert server.connections == 2
    await pool.aclose()


async def test_idle_connection_closed_by_server_is_retried(server: Server) -> None:
    server.close_after_each = True
    server.responses = [_ok(b"1"), _ok(b"2")]
    pool = Http1Pool()
    assert await pool.fetch("GET", server.url + "/") == (200, b"1")
    await asyncio.wait_for(server.closed.wait(), 10)  # the pooled connection is now a closed one
    assert await pool.fetch("GET", server.url + "/") == (200, b"2")
    assert server.connections == 2  # the second request went over a new connection
    await pool.aclose()


async def test_errors_are_oserrors() -> None:
    pool = Http1Pool(connect_timeout_s=1)
    with pytest.raises(OSError):
        await pool.fetch("GET", f"http://127.0.0.1:{_closed_port()}/")
    with pytest.raises(ValueError):
        split_url("https://example.com/")


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])
