"""engine_sim's HTTP API: the subset of SGLang 0.5.23's routes Poise uses (sglang/srt/entrypoints/http_server.py),
as small route handlers over the one engine on the app's state: generation (generation_routes.py), health and
information (info_routes.py), control (control_routes.py)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from http import HTTPStatus

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from services.engine_sim import control_routes, generation_routes, info_routes
from services.engine_sim import protocol as P
from services.engine_sim.answers import openai_error, schema_error
from services.engine_sim.auth import ApiKeyMiddleware
from services.engine_sim.engine import SimEngine


def create_app(engine: SimEngine) -> FastAPI:
    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        await engine.start()
        try:
            yield
        finally:
            await engine.stop()

    app = FastAPI(title="poise engine_sim", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    if engine.settings.api_key:
        app.add_middleware(ApiKeyMiddleware, api_key=engine.settings.api_key)
    app.state.engine = engine
    app.add_exception_handler(StarletteHTTPException, _http_error)  # type: ignore[arg-type]
    app.add_exception_handler(RequestValidationError, _validation_error)  # type: ignore[arg-type]
    app.add_exception_handler(P.SchemaError, _schema_error)  # type: ignore[arg-type]
    for routes in (generation_routes, info_routes, control_routes):
        app.include_router(routes.router)
    return app


async def _http_error(_: Request, exc: StarletteHTTPException) -> Response:
    # SGLang renders HTTPException as ErrorResponse with type = the status code.
    return openai_error(str(exc.detail), str(exc.status_code), exc.status_code)


async def _schema_error(_: Request, exc: P.SchemaError) -> Response:
    return schema_error(exc)  # a malformed body, wherever a route reads it


async def _validation_error(_: Request, exc: RequestValidationError) -> Response:
    return openai_error(str(exc), HTTPStatus.BAD_REQUEST.phrase, 400)
