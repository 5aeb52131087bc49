"""A header-read timeout for uvicorn, which has none: a client must send its request headers within a bound.

Without it, a client that trickles its request line and headers (one byte every few seconds) holds a
connection, and a task, as long as it likes (slowloris). nginx's ``client_header_timeout`` does this in front
of a deployment; the gateway does it itself so that ``poise up`` and a gateway without a proxy have it too.

:func:`protocol_with_header_timeout` gives uvicorn (``http=``) a subclass of its httptools protocol that arms a
timer when a connection opens and when the first byte of each further request arrives, and disarms it when
the request's headers are complete. When it fires, a request that had begun gets a 408 with an
OpenAI-style error body and the connection closes; a connection that sent nothing is closed without an
answer (it never asked anything, and a keep-alive client would otherwise read the 408 as the answer to its
next request). The body has its own bound (the gateway's ``body_timeout_s``).
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

_BODY = json.dumps({"error": {"message": "the request headers did not arrive in time", "type": "invalid_request_error",
                              "param": None, "code": "request_timeout"}}).encode()
RESPONSE_408 = (b"HTTP/1.1 408 Request Timeout\r\ncontent-type: application/json\r\nconnection: close\r\n"
                b"content-length: " + str(len(_BODY)).encode() + b"\r\n\r\n" + _BODY)


def protocol_with_header_timeout(timeout_s: float) -> type[asyncio.Protocol]:
    """uvicorn's httptools protocol with a ``timeout_s`` header-read timeout (module doc)."""

    class HeaderTimeoutProtocol(HttpToolsProtocol):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self._header_timer: asyncio.TimerHandle | None = None
            self._request_begun = False

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            self._arm()

        def on_message_begin(self) -> None:
            super().on_message_begin()
            self._request_begun = True
            if self._header_timer is None:
                self._arm()

        def on_headers_complete(self) -> None:
            self._disarm()
            self._request_begun = False
            super().on_headers_complete()

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm()
            super().connection_lost(exc)

        def _arm(self) -> None:
            self._header_timer = self.loop.call_later(timeout_s, self._timed_out)

        def _disarm(self) -> None:
            if self._header_timer is not None:
                self._header_timer.cancel()
                self._header_timer = None

        def _timed_out(self) -> None:
            self._header_timer = None
            if self.transport.is_closing():
                return
            if self._request_begun:
                self.transport.write(RESPONSE_408)
            self.transport.close()

    return HeaderTimeoutProtocol
