"""A small, fast keep-alive HTTP/1.1 client for the request plane (gateway → engines).

Why not httpx: on this path every client request costs one or two engine requests, and httpx/httpcore spend
about a millisecond of CPU on each (pool bookkeeping, header models, anyio streams, a thread for every new
connection's address lookup). Profiling the gateway at 200 req/s on two cores put more than half its CPU
there. This client does only what the engines need: one request per connection at a time, bodies with
Content-Length or chunked transfer encoding, streamed reads, and a per-peer pool of idle connections.

It raises :class:`OSError` (or :class:`TimeoutError`) for anything that goes wrong on the wire, so callers
have one family to catch.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from urllib.parse import urlsplit

_Conn = tuple[asyncio.StreamReader, asyncio.StreamWriter]
_STREAM_LIMIT = 1 << 20  # longest header block / line we accept


def split_url(url: str) -> tuple[str, int, str]:
    """``http://host:port/path?query`` → (host, port, request target ``/path?query``)."""
    parts = urlsplit(url)
    if parts.scheme != "http" or not parts.hostname:
        raise ValueError(f"only http://host:port URLs are supported, got {url!r}")
    target = parts.path or "/"
    return parts.hostname, parts.port or 80, f"{target}?{parts.query}" if parts.query else target


class Response:
    """A response whose head has been read; read or iterate the body, then :meth:`aclose`."""

    def __init__(self, pool: Http1Pool, peer: tuple[str, int], conn: _Conn, status: int,
                 headers: dict[bytes, bytes], length: int | None, chunked: bool, keep_alive: bool) -> None:
        self._pool = pool
        self._peer = peer
        self._conn: _Conn | None = conn
        self.status = status
        self.headers = headers
        self._length = length
        self._chunked = chunked
        self._keep_alive = keep_alive
        self._done = False

    async def aiter_raw(self) -> AsyncIterator[bytes]:
        assert self._conn is not None, "response already closed"
        reader = self._conn[0]
        if self._chunked:
            while True:
                size_line = await reader.readuntil(b"\r\n")
                size = int(size_line.split(b";", 1)[0], 16)
                if size == 0:
                    while await reader.readuntil(b"\r\n") != b"\r\n":  # trailers, then the blank line
                        pass
                    break
                data = await reader.readexactly(size)
                await reader.readexactly(2)
                yield data
        elif self._length is not None:
            remaining = self._length
            while remaining > 0:
                data = await reader.read(min(remaining, 65536))
                if not data:
                    raise OSError("connection closed in the middle of a response body")
                remaining -= len(data)
                yield data
        else:  # no framing: the body runs to the end of the connection
            self._keep_alive = False
            while data := await reader.read(65536):
                yield data
        self._done = True

    async def aiter_lines(self) -> AsyncIterator[bytes]:
        """Body lines without their line ending (what an SSE reader wants)."""
        buffer = b""
        async for data in self.aiter_raw():
            buffer += data
            if b"\n" not in buffer:
                continue
            *lines, buffer = buffer.split(b"\n")
            for line in lines:
                yield line.rstrip(b"\r")
        if buffer:
            yield buffer.rstrip(b"\r")

    async def read(self) -> bytes:
        return b"".join([chunk async for chunk in self.aiter_raw()])

    def close(self) -> None:
        """Give the connection back if the body was read to its end, otherwise drop it."""
        conn, self._conn = self._conn, None
        if conn is None:
            return
        if self._done and self._keep_alive:
            self._pool._release(self._peer, conn)
        else:
            conn[1].close()

    async def aclose(self) -> None:
        self.close()

    def abort(self) -> None:
        """Drop the connection now: a read waiting on it ends with EOF (how a stalled stream is given up)."""
        conn, self._conn = self._conn, None
        if conn is not None:
            conn[1].transport.abort()


class Http1Pool:
    """Keep-alive connections per (host, port); a connection carries one request at a time."""

    def __init__(self, *, connect_timeout_s: float = 5.0, max_idle_per_peer: int = 512,
                 headers: dict[str, str] | None = None) -> None:
        # ``headers``: sent with every request (the engines' Authorization)
        self._extra_head = "".join(f"{k}: {v}\r\n" for k, v in (headers or {}).items())
        self._idle: dict[tuple[str, int], list[_Conn]] = {}
        self._connect_timeout_s = connect_timeout_s
        self._max_idle = max_idle_per_peer
        self._closed = False

    async def request(self, method: str, url: str, body: bytes | None = None, *,
                      content_type: str = "application/json") -> Response:
        """Send a request and read the response head; the body is left for the caller to read."""
        host, port, target = split_url(url)
        peer = (host, port)
        head = (f"{method} {target} HTTP/1.1\r\nHost: {host}:{port}\r\nContent-Length: {len(body) if body else 0}\r\n"
                f"Content-Type: {content_type}\r\nAccept: */*\r\n{self._extra_head}\r\n").encode()
        payload = head + body if body else head
        for attempt in (0, 1):
            conn, reused = self._checkout(peer)
            if conn is None:
                try:
                    conn = await asyncio.wait_for(asyncio.open_connection(host, port, limit=_STREAM_LIMIT),
                                                  self._connect_timeout_s)
                except TimeoutError as exc:
                    raise TimeoutError(f"connecting to {host}:{port} timed out") from exc
            try:
                conn[1].write(payload)
                return await self._read_head(peer, conn)
            except (OSError, asyncio.IncompleteReadError, asyncio.LimitOverrunError, ValueError) as exc:
                conn[1].close()
                # A reused connection may have been closed by the server while idle: one retry on a new one.
                if reused and attempt == 0 and not isinstance(exc, ValueError):
                    continue
                raise OSError(f"{method} {url}: {exc!r}") from exc
            except BaseException:  # cancelled mid-request: the connection's state is unknown
                conn[1].close()
                raise
        raise AssertionError("unreachable")

    async def fetch(self, method: str, url: str, body: bytes | None = None) -> tuple[int, bytes]:
        """Send a request and read the whole response body: (status, body)."""
        response = await self.request(method, url, body)
        try:
            return response.status, await response.read()
        finally:
            response.close()

    async def post_json(self, url: str, body: bytes) -> tuple[int, bytes]:
        return await self.fetch("POST", url, body)

    async def _read_head(self, peer: tuple[str, int], conn: _Conn) -> Response:
        raw = await conn[0].readuntil(b"\r\n\r\n")
        lines = raw[:-4].split(b"\r\n")
        version, _, rest = lines[0].partition(b" ")
        if not version.startswith(b"HTTP/1."):
            raise ValueError(f"not an HTTP/1.x response: {lines[0][:80]!r}")
        status = int(rest[:3])
        headers: dict[bytes, bytes] = {}
        for line in lines[1:]:
            name, _, value = line.partition(b":")
            headers[name.strip().lower()] = value.strip()
        keep_alive = version == b"HTTP/1.1" and headers.get(b"connection", b"").lower() != b"close"
        chunked = b"chunked" in headers.get(b"transfer-encoding", b"").lower()
        length = None if chunked or b"content-length" not in headers else int(headers[b"content-length"])
        if status in (204, 304) or 100 <= status < 200:
            length = 0
        return Response(self, peer, conn, status, headers, length, chunked, keep_alive)

    def _checkout(self, peer: tuple[str, int]) -> tuple[_Conn | None, bool]:
        idle = self._idle.get(peer)
        while idle:
            reader, writer = idle.pop()
            if not reader.at_eof() and not writer.is_closing():
                return (reader, writer), True
            writer.close()
        return None, False

    def _release(self, peer: tuple[str, int], conn: _Conn) -> None:
        idle = self._idle.setdefault(peer, [])
        if self._closed or len(idle) >= self._max_idle or conn[0].at_eof():
            conn[1].close()
        else:
            idle.append(conn)

    async def aclose(self) -> None:
        self._closed = True
        for conns in self._idle.values():
            for _, writer in conns:
                writer.close()
                with contextlib.suppress(OSError):
                    await writer.wait_closed()
        self._idle.clear()
