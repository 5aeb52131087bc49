"""Reading a request body under limits: JSON content type (415), a size cap (413), a deadline (408).

The cap is checked on ``Content-Length`` before a byte is read and again while reading (a chunked body has
no length), so an oversized body never sits whole in the gateway's memory; an oversized body (declared or
found) is read and dropped, up to a bounded amount, before the 413, so that a client still sending sees the 413
rather than a reset (one that sent ``Expect: 100-continue`` gets it at once). The deadline runs from the
moment the headers arrived: a client trickling its body cannot hold a connection and a slot open. These
errors answer before the body was read to its end, so they close the connection.
"""

from __future__ import annotations

import asyncio
import contextlib

from fastapi import Request
from starlette.requests import ClientDisconnect

from services.gateway.errors import APIError

_CLOSE = {"connection": "close"}
DISCARD_FACTOR = 8  # an oversized body is read and dropped up to this many times the limit before the 413
DISCARD_TIMEOUT_S = 5.0  # ... or for this long


def _media_type(request: Request) -> str:
    return request.headers.get("content-type", "").split(";", 1)[0].strip().lower()


def require_json(request: Request) -> None:
    """415 unless the body is declared ``application/json`` (parameters such as ``charset`` are fine)."""
    media = _media_type(request)
    if media != "application/json":
        shown = f"'{media}'" if media else "none"
        raise APIError(415, f"Content-Type must be application/json, got {shown}", code="unsupported_media_type",
                       headers=_CLOSE)


async def read_body(request: Request, *, max_bytes: int, timeout_s: float) -> bytes:
    """The whole body, or :class:`APIError` 413 (over ``max_bytes``) or 408 (not in within ``timeout_s``)."""
    declared = request.headers.get("content-length")
    if declared is not None:
        try:
            length = int(declared)
        except ValueError:
            raise APIError(400, f"Content-Length is not a number: {declared[:40]!r}", headers=_CLOSE) from None
        if length > max_bytes:
            # A client that asked first (Expect: 100-continue) or whose body is past what we drop is answered
            # now; any other is still writing a body it declared, so it is drained first, or it would get a
            # reset instead of the 413.
            if length <= DISCARD_FACTOR * max_bytes and "100-continue" not in request.headers.get("expect", ""):
                await _discard_rest(request, 0, max_bytes)
            raise _too_large(length, max_bytes)
    chunks: list[bytes] = []
    size = 0
    try:
        async with asyncio.timeout(timeout_s):
            async for chunk in request.stream():
                size += len(chunk)
                if size > max_bytes:
                    chunks.clear()
                    await _discard_rest(request, size, max_bytes)
                    raise _too_large(size, max_bytes)
                chunks.append(chunk)
    except ClientDisconnect:
        raise APIError(499, "the client hung up while sending the body", code="client_disconnected") from None
    except TimeoutError:
        raise APIError(408, f"the request body did not arrive within {timeout_s:g} s ({size} bytes read)",
                       code="request_timeout", headers=_CLOSE) from None
    return b"".join(chunks)


async def _discard_rest(request: Request, size: int, max_bytes: int) -> None:
    """Read and drop what is left of an oversized body (a bounded amount), so the client, still sending, gets
    to read the 413 instead of a connection reset."""
    with contextlib.suppress(TimeoutError, ClientDisconnect):
        async with asyncio.timeout(DISCARD_TIMEOUT_S):
            async for chunk in request.stream():
                size += len(chunk)
                if size > DISCARD_FACTOR * max_bytes:
                    return


def _too_large(size: int, max_bytes: int) -> APIError:
    return APIError(413, f"request body of {size} bytes or more is above this gateway's limit of {max_bytes} bytes",
                    code="request_too_large", headers=_CLOSE)
