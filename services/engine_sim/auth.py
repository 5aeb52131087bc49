"""SGLang's ``--api-key`` on engine_sim: every endpoint but health, readiness and metrics wants
``Authorization: Bearer <key>`` (sglang/srt/utils/auth.py ``decide_request_auth``, NORMAL level: the
scheme case-insensitive, the key compared in constant time; 401 ``{"error": "Unauthorized"}`` otherwise)."""

from __future__ import annotations

import hmac
from typing import Any

import orjson

_OPEN_PREFIXES = ("/health", "/ready", "/metrics")  # k8s probes and Prometheus scrape without a secret


def allowed(method: str, path: str, authorization: str | None, api_key: str) -> bool:
    if method == "OPTIONS" or path.startswith(_OPEN_PREFIXES):
        return True
    scheme, _, token = (authorization or "").partition(" ")
    return scheme.lower() == "bearer" and hmac.compare_digest(token.encode(), api_key.encode())


class ApiKeyMiddleware:
    """Pure ASGI (a client's disconnect still reaches the streaming endpoints)."""

    def __init__(self, app: Any, *, api_key: str) -> None:
        self.app = app
        self.api_key = api_key

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "http":
            header = next((v.decode("latin-1") for k, v in scope["headers"] if k == b"authorization"), None)
            if not allowed(scope["method"], scope["path"], header, self.api_key):
                await send({"type": "http.response.start", "status": 401,
                            "headers": [(b"content-type", b"application/json")]})
                await send({"type": "http.response.body", "body": orjson.dumps({"error": "Unauthorized"})})
                return
        await self.app(scope, receive, send)
