"""OpenAI-style error responses: ``{"error": {"message", "type", "param", "code"}}`` with the right status."""

from __future__ import annotations

import orjson
from fastapi.responses import Response


class APIError(Exception):
    """An error a client caused or must react to; rendered as an OpenAI error body."""

    def __init__(self, status: int, message: str, *, type_: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type_
        self.param = param
        self.code = code
        self.headers = headers or {}

    def body(self) -> dict[str, object]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> Response:
        return Response(orjson.dumps(self.body()), status_code=self.status, media_type="application/json",
                        headers=self.headers)


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)
