"""The gateway's HTTP API: OpenAI ``/v1/completions``, ``/v1/chat/completions``, ``/v1/models``, health, metrics."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.utils import get_openapi
from fastapi.responses import PlainTextResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException

from services.gateway.errors import APIError
from services.gateway.inference import InferenceRoutes, json_response
from services.gateway.openapi import (
    HEALTH_ROUTE,
    METRICS_ROUTE,
    MODEL_ROUTE,
    MODEL_ROUTES,
    ChatCompletionRequest,
    ChatCompletionResponse,
    CompletionRequest,
    CompletionResponse,
    DeploymentBounds,
    finish_document,
    inference_route,
)
from services.gateway.service import GatewayService
from services.gateway.validation import model_not_found


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

    routes = InferenceRoutes(service)

    # Registered with FastAPI too, so OPTIONS/405 and the route list stay right; POSTs take the lean path.
    app.add_api_route("/v1/completions", routes.completions, methods=["POST"],
                      **inference_route(CompletionRequest, CompletionResponse))
    app.add_api_route("/v1/chat/completions", routes.chat_completions, methods=["POST"],
                      **inference_route(ChatCompletionRequest, ChatCompletionResponse))

    def _model(name: str, now: int) -> dict[str, Any]:
        return {"id": name, "object": "model", "created": now, "owned_by": "poise"}

    @app.get("/v1/models", **MODEL_ROUTES)
    async def models(request: Request) -> Response:
        routes.authorize(request)
        now = int(time.time())
        return json_response({"object": "list", "data": [_model(m, now) for m in service.cluster.served_models()]})

    @app.get("/v1/models/{model:path}", **MODEL_ROUTE)  # a path: model names such as meta-llama/Llama-3.1-8B-Instruct have a /
    async def model(request: Request, model: str) -> Response:
        routes.authorize(request)
        served = service.cluster.served_models()
        if model not in served:
            raise model_not_found(model, served)
        return json_response(_model(model, int(time.time())))

    @app.get("/health", **HEALTH_ROUTE)
    async def health() -> Response:
        body, serving = service.health()  # 200 exactly when a request can be served (GatewayService.health)
        return json_response(body, 200 if serving else 503)

    @app.get("/metrics", response_class=PlainTextResponse, **METRICS_ROUTE)
    async def metrics() -> Response:
        return Response(generate_latest(service.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            bounds = DeploymentBounds(max_tokens_limit=service.settings.max_tokens_limit,
                                      min_ttft_s=service.slo_table.min_ttft_s,
                                      slo_classes=tuple(sorted(service.slo_table.classes)))
            app.openapi_schema = finish_document(get_openapi(title=app.title, version=app.version, routes=app.routes),
                                                 bounds)
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]
    return GatewayApp(app, {"/v1/completions": routes.completions, "/v1/chat/completions": routes.chat_completions})
