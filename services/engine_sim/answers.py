"""What every engine_sim route answers with: JSON bodies and SGLang's error shapes, and the engine itself."""

from __future__ import annotations

from http import HTTPStatus
from typing import Any

import orjson
from fastapi import Request
from fastapi.responses import Response

from services.engine_sim import protocol as P
from services.engine_sim.engine import SimEngine

JSON = "application/json"


def engine_of(request: Request) -> SimEngine:
    """The engine the app serves (``create_app`` puts it on the app's state)."""
    engine: SimEngine = request.app.state.engine
    return engine


def json_response(body: Any, status: int = 200) -> Response:
    return Response(orjson.dumps(body), status_code=status, media_type=JSON)


def openai_error(message: str, err_type: str = "BadRequestError", status: int = 400,
                  param: str | None = None) -> Response:
    return json_response(P.error_body(message, err_type, status, param), status)


def schema_error(exc: P.SchemaError) -> Response:
    # SGLang's RequestValidationError handler: 400 with type "Bad Request".
    return openai_error(str(exc), HTTPStatus.BAD_REQUEST.phrase, 400, exc.param)
