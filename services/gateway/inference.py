"""The gateway's two inference routes, /v1/completions and /v1/chat/completions: authorise, read and check
the body, hand the request to its :class:`RequestFlow`, and answer with one JSON body or the stream.

They run on the gateway app's lean path (services/gateway/app.py); their errors are rendered by the same
handlers as the rest of the API's. A client that hangs up before its stream starts cancels the request, so
both engines are told to stop at once; after that the stream's own close does it.
"""

from __future__ import annotations

import asyncio
import hmac
import time
from collections.abc import AsyncIterator
from typing import Any

import orjson
from fastapi import Request
from fastapi.responses import Response, StreamingResponse

from services.gateway.body import read_body, require_json
from services.gateway.errors import APIError
from services.gateway.flow import RequestFlow
from services.gateway.service import GatewayService
from services.gateway.validation import Endpoint, ParsedRequest, model_not_found, parse_request, seed_not_applied
from shared.protocol.refusal import RETRY_COUNT_HEADER, sent_before


def json_response(body: Any, status: int = 200, headers: dict[str, str] | None = None) -> Response:
    return Response(orjson.dumps(body), status_code=status, media_type="application/json", headers=headers)


class InferenceRoutes:
    def __init__(self, service: GatewayService) -> None:
        self.service = service
        self.settings = service.settings

    def authorize(self, request: Request) -> None:
        """The client's bearer key is one of the gateway's (when it has any), else 401."""
        if not self.settings.api_keys:
            return
        header = request.headers.get("authorization", "")
        token = header[7:] if header.lower().startswith("bearer ") else ""
        if not any(hmac.compare_digest(token, key) for key in self.settings.api_keys):
            raise APIError(401, "Incorrect or missing API key: pass 'Authorization: Bearer <key>'",
                           type_="invalid_request_error", code="invalid_api_key")

    async def _admit(self, request: Request, endpoint: Endpoint) -> ParsedRequest:
        """The request, authorised, read and checked against what this deployment serves (or its 4xx/503)."""
        self.authorize(request)
        require_json(request)
        s = self.settings
        raw = await read_body(request, max_bytes=s.max_body_bytes, timeout_s=s.body_timeout_s)
        parsed = parse_request(raw, endpoint, counter=self.service.counter, default_max_tokens=s.default_max_tokens,
                               max_tokens_limit=s.max_tokens_limit, slo_table=self.service.slo_table,
                               max_depth=s.max_json_depth)
        parsed.retries = sent_before(request.headers.get(RETRY_COUNT_HEADER))
        cluster = self.service.cluster
        served = cluster.served_models()
        if parsed.model not in served:
            if not served:
                raise APIError(503, "no engine is registered yet", type_="service_unavailable", code="no_capacity")
            raise model_not_found(parsed.model, served)
        if parsed.body.get("seed") is not None and not (s.accept_unapplied_seed or cluster.applies_seed(parsed.model)):
            raise seed_not_applied(parsed.model)
        if parsed.slo is not None:
            name = parsed.slo.slo_class
            label = name if name in self.service.slo_table.classes else "(none)" if name is None else "(custom)"
            self.service.metrics.slo_requests.labels(label, parsed.slo.source).inc()
        return parsed

    async def serve(self, request: Request, endpoint: Endpoint) -> Response:
        arrived = time.monotonic()  # the client's clock starts before the body is read and parsed
        parsed = await self._admit(request, endpoint)
        flow = self.service.new_flow(parsed, arrived)
        self.service.metrics.inflight.inc()
        # Until a streaming response takes over (Starlette watches the connection then), a client that hangs
        # up cancels this task, so both engines are told to stop at once.
        watch = _DisconnectWatch(request)
        try:
            async with asyncio.timeout(self.settings.request_timeout_s):
                await flow.start()
                body = None if parsed.stream else await flow.collect()
        except asyncio.CancelledError:
            if not watch.fired:
                self.service.finish(flow, status="aborted", error="cancelled")
                raise
            watch.acknowledge()
            self.service.finish(flow, status="aborted", error="client disconnected")
            return Response(status_code=499)
        except TimeoutError:
            self.service.finish(flow, status="error", error="timeout")
            raise APIError(504, f"request timed out after {self.settings.request_timeout_s:.0f}s",
                           type_="timeout_error", code="timeout") from None
        except APIError as exc:
            self.service.finish(flow, status="error", error=exc.message)
            raise
        except Exception as exc:
            error = f"{type(exc).__name__}: {exc}"
            self.service.finish(flow, status="error", error=error)
            raise APIError(502, f"the engine stream broke: {error}", type_="server_error") from None
        finally:
            watch.stop()
        if parsed.stream:
            return _ClosingStreamingResponse(self._stream(flow), media_type="text/event-stream",
                                             headers={"cache-control": "no-cache", "x-request-id": flow.client_id})
        self.service.finish(flow)
        return json_response(body, headers={"x-request-id": flow.client_id})

    async def _stream(self, flow: RequestFlow) -> AsyncIterator[bytes]:
        status, error = "ok", None
        deadline = flow.arrived + self.settings.request_timeout_s
        try:
            async with asyncio.timeout_at(asyncio.get_running_loop().time() + max(0.0, deadline - time.monotonic())):
                async for event in flow.events():
                    chunk = flow.sse_chunk(event)
                    if chunk is not None:
                        yield chunk
            yield b"data: [DONE]\n\n"
        except TimeoutError:
            status, error = "error", "timeout"
            yield _sse_error(504, f"request timed out after {self.settings.request_timeout_s:.0f}s", "timeout_error")
        except (asyncio.CancelledError, GeneratorExit):
            status, error = "aborted", "client disconnected"
            raise
        except Exception as exc:
            status, error = "error", f"{type(exc).__name__}: {exc}"
            yield _sse_error(502, f"the stream broke after the first token: {error}", "server_error")
        finally:
            self.service.finish(flow, status=status, error=error)

    async def completions(self, request: Request) -> Response:
        return await self.serve(request, "completions")

    async def chat_completions(self, request: Request) -> Response:
        return await self.serve(request, "chat")


class _ClosingStreamingResponse(StreamingResponse):
    """A StreamingResponse that always closes its generator, so the request's cleanup runs at once.

    Starlette notices a client that hung up only when a send fails, and then abandons the generator at its
    ``yield``; its ``finally`` (abort both legs, release the engines' slots) would wait for garbage
    collection. Closing it here runs that cleanup right away.
    """

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            aclose = getattr(self.body_iterator, "aclose", None)
            if aclose is not None:
                await aclose()


class _DisconnectWatch:
    """Cancels the current task when the client disconnects (one small task per request)."""

    def __init__(self, request: Request) -> None:
        self.fired = False
        task = asyncio.current_task()
        assert task is not None
        self._task = task
        self._watcher = asyncio.ensure_future(_disconnected(request))
        self._watcher.add_done_callback(self._on_done)

    def _on_done(self, watcher: asyncio.Future[None]) -> None:
        if not watcher.cancelled() and watcher.exception() is None:
            self.fired = True
            self._task.cancel()

    def acknowledge(self) -> None:
        """The cancellation was handled: clear it so the task can still await (e.g. to send a response)."""
        self._task.uncancel()

    def stop(self) -> None:
        self._watcher.remove_done_callback(self._on_done)
        self._watcher.cancel()


async def _disconnected(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


def _sse_error(status: int, message: str, type_: str) -> bytes:
    body = {"error": {"message": message, "type": type_, "param": None, "code": status}}
    return b"data: " + orjson.dumps(body) + b"\n\ndata: [DONE]\n\n"
