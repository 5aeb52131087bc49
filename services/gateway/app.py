"""The gateway's HTTP API: OpenAI ``/v1/completions``, ``/v1/chat/completions``, ``/v1/models``, health, metrics."""

from __future__ import annotations

import asyncio
import hmac
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any

import orjson
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.utils import get_openapi
from fastapi.responses import PlainTextResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException

from services.gateway.body import read_body, require_json
from services.gateway.errors import APIError
from services.gateway.flow import RequestFlow
from services.gateway.openapi import (
    HEALTH_ROUTE,
    METRICS_ROUTE,
    MODEL_ROUTE,
    MODEL_ROUTES,
    ChatCompletionRequest,
    ChatCompletionResponse,
    CompletionRequest,
    CompletionResponse,
    finish_document,
    inference_route,
)
from services.gateway.service import GatewayService
from services.gateway.validation import Endpoint, model_not_found, parse_request, seed_not_applied


def _json(body: Any, status: int = 200, headers: dict[str, str] | None = None) -> Response:
    return Response(orjson.dumps(body), status_code=status, media_type="application/json", headers=headers)


class GatewayApp:
    """The gateway's ASGI app: a lean path for the two inference routes, FastAPI for everything else.

    Profiling at 200 req/s put as much of the gateway's CPU in FastAPI's middleware and routing as in the
    request's own work; the inference routes are the only hot ones, so they bypass that stack (their errors
    are rendered by the same handlers) while the rest of the API keeps FastAPI.
    """

    def __init__(self, api: FastAPI, hot: dict[str, Callable[[Request], Awaitable[Response]]]) -> None:
        self.api = api
        self._hot = hot

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        handler = self._hot.get(scope["path"]) if scope["type"] == "http" and scope["method"] == "POST" else None
        if handler is None:
            await self.api(scope, receive, send)
            return
        request = Request(scope, receive)
        try:
            response = await handler(request)
        except APIError as exc:
            response = exc.response()
        except Exception as exc:  # the same last resort FastAPI's handler gives the other routes
            response = _unexpected_error(exc)
        await response(scope, receive, send)


def _unexpected_error(exc: Exception) -> Response:
    return APIError(500, f"internal error: {type(exc).__name__}: {exc}", type_="server_error").response()


def create_app(service: GatewayService) -> GatewayApp:
    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        await service.start()
        try:
            yield
        finally:
            await service.stop()

    app = FastAPI(title="Poise gateway", lifespan=lifespan, docs_url=None, redoc_url=None)
    settings = service.settings

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> Response:
        return exc.response()

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> Response:
        type_ = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        # Starlette's 405 carries the route's Allow header, which RFC 9110 requires on a 405
        return APIError(exc.status_code, str(exc.detail), type_=type_, headers=dict(exc.headers or {})).response()

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError) -> Response:
        return APIError(400, str(exc)).response()

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> Response:
        return _unexpected_error(exc)

    def _authorize(request: Request) -> None:
        if not settings.api_keys:
            return
        header = request.headers.get("authorization", "")
        token = header[7:] if header.lower().startswith("bearer ") else ""
        if not any(hmac.compare_digest(token, key) for key in settings.api_keys):
            raise APIError(401, "Incorrect or missing API key: pass 'Authorization: Bearer <key>'",
                           type_="invalid_request_error", code="invalid_api_key")

    async def _serve(request: Request, endpoint: Endpoint) -> Response:
        arrived = time.monotonic()  # the client's clock starts before the body is read and parsed
        _authorize(request)
        require_json(request)
        raw = await read_body(request, max_bytes=settings.max_body_bytes, timeout_s=settings.body_timeout_s)
        parsed = parse_request(raw, endpoint, counter=service.counter, default_max_tokens=settings.default_max_tokens,
                               max_tokens_limit=settings.max_tokens_limit, slo_table=service.slo_table,
                               max_depth=settings.max_json_depth)
        served = service.cluster.served_models()
        if parsed.model not in served:
            if not served:
                raise APIError(503, "no engine is registered yet", type_="service_unavailable", code="no_capacity")
            raise model_not_found(parsed.model, served)
        if parsed.body.get("seed") is not None and not (settings.accept_unapplied_seed
                                                         or service.cluster.applies_seed(parsed.model)):
            raise seed_not_applied(parsed.model)
        if parsed.slo is not None:
            name = parsed.slo.slo_class
            label = name if name in service.slo_table.classes else "(none)" if name is None else "(custom)"
            service.metrics.slo_requests.labels(label, parsed.slo.source).inc()
        flow = service.new_flow(parsed, arrived)
        service.metrics.inflight.inc()
        # Until a streaming response takes over (Starlette watches the connection then), a client that hangs
        # up cancels this task, so both engines are told to stop at once.
        watch = _DisconnectWatch(request)
        try:
            async with asyncio.timeout(settings.request_timeout_s):
                await flow.start()
                body = None if parsed.stream else await flow.collect()
        except asyncio.CancelledError:
            if not watch.fired:
                service.finish(flow, status="aborted", error="cancelled")
                raise
            watch.acknowledge()
            service.finish(flow, status="aborted", error="client disconnected")
            return Response(status_code=499)
        except TimeoutError:
            service.finish(flow, status="error", error="timeout")
            raise APIError(504, f"request timed out after {settings.request_timeout_s:.0f}s",
                           type_="timeout_error", code="timeout") from None
        except APIError as exc:
            service.finish(flow, status="error", error=exc.message)
            raise
        except Exception as exc:
            error = f"{type(exc).__name__}: {exc}"
            service.finish(flow, status="error", error=error)
            raise APIError(502, f"the engine stream broke: {error}", type_="server_error") from None
        finally:
            watch.stop()
        if parsed.stream:
            return _ClosingStreamingResponse(_stream(flow), media_type="text/event-stream",
                                             headers={"cache-control": "no-cache", "x-request-id": flow.client_id})
        service.finish(flow)
        return _json(body, headers={"x-request-id": flow.client_id})

    async def _stream(flow: RequestFlow) -> AsyncIterator[bytes]:
        status, error = "ok", None
        deadline = flow.arrived + settings.request_timeout_s
        try:
            async with asyncio.timeout_at(asyncio.get_running_loop().time() + max(0.0, deadline - time.monotonic())):
                async for event in flow.events():
                    chunk = flow.sse_chunk(event)
                    if chunk is not None:
                        yield chunk
            yield b"data: [DONE]\n\n"
        except TimeoutError:
            status, error = "error", "timeout"
            yield _sse_error(504, f"request timed out after {settings.request_timeout_s:.0f}s", "timeout_error")
        except (asyncio.CancelledError, GeneratorExit):
            status, error = "aborted", "client disconnected"
            raise
        except Exception as exc:
            status, error = "error", f"{type(exc).__name__}: {exc}"
            yield _sse_error(502, f"the stream broke after the first token: {error}", "server_error")
        finally:
            service.finish(flow, status=status, error=error)

    async def completions(request: Request) -> Response:
        return await _serve(request, "completions")

    async def chat_completions(request: Request) -> Response:
        return await _serve(request, "chat")

    # Registered with FastAPI too, so OPTIONS/405 and the route list stay right; POSTs take the lean path.
    app.add_api_route("/v1/completions", completions, methods=["POST"],
                      **inference_route(CompletionRequest, CompletionResponse))
    app.add_api_route("/v1/chat/completions", chat_completions, methods=["POST"],
                      **inference_route(ChatCompletionRequest, ChatCompletionResponse))

    def _model(name: str, now: int) -> dict[str, Any]:
        return {"id": name, "object": "model", "created": now, "owned_by": "poise"}

    @app.get("/v1/models", **MODEL_ROUTES)
    async def models(request: Request) -> Response:
        _authorize(request)
        now = int(time.time())
        return _json({"object": "list", "data": [_model(m, now) for m in service.cluster.served_models()]})

    @app.get("/v1/models/{model:path}", **MODEL_ROUTE)  # a path: model names such as meta-llama/Llama-3.1-8B-Instruct have a /
    async def model(request: Request, model: str) -> Response:
        _authorize(request)
        served = service.cluster.served_models()
        if model not in served:
            raise model_not_found(model, served)
        return _json(_model(model, int(time.time())))

    @app.get("/health", **HEALTH_ROUTE)
    async def health() -> Response:
        body, serving = service.health()  # 200 exactly when a request can be served (GatewayService.health)
        return _json(body, 200 if serving else 503)

    @app.get("/metrics", response_class=PlainTextResponse, **METRICS_ROUTE)
    async def metrics() -> Response:
        return Response(generate_latest(service.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            app.openapi_schema = finish_document(get_openapi(title=app.title, version=app.version, routes=app.routes))
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]
    return GatewayApp(app, {"/v1/completions": completions, "/v1/chat/completions": chat_completions})


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
