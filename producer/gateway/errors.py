"""Errors the gateway answers with, all in OpenAI's shape."""

from __future__ import annotations

from collections.abc import Mapping
from typing import cast

from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse

from mlxq.producer.openai_api import error_body

#: OpenAI's error ``type`` for each status the gateway answers with.
_TYPES = {
    400: "invalid_request_error",
    401: "invalid_request_error",
    404: "invalid_request_error",
    405: "invalid_request_error",
    409: "invalid_request_error",
    413: "invalid_request_error",
    415: "invalid_request_error",
    429: "rate_limit_error",
}


class APIError(Exception):
    """An HTTP error response: ``{"error": {"message", "type", "param", "code"}}``.

    Args:
        status: HTTP status.
        message: What went wrong, for people.
        type_: OpenAI's error type; by default the one its status implies.
        param: The request field at fault, if one is.
        code: A short machine-readable code (``"model_not_found"``), if any.
        headers: Extra response headers (``Retry-After``, ``WWW-Authenticate``).
    """

    def __init__(
        self,
        status: int,
        message: str,
        type_: str | None = None,
        param: str | None = None,
        code: str | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.type = type_ or _TYPES.get(status, "server_error")
        self.headers = dict(headers or {})

    def response(self) -> JSONResponse:
        body = error_body(self.message, self.type, self.param, self.code)
        return JSONResponse(body, status_code=self.status, headers=self.headers)


async def api_error_handler(request: Request, exc: Exception) -> JSONResponse:
    return cast(APIError, exc).response()  # registered for APIError only


async def http_error_handler(request: Request, exc: Exception) -> JSONResponse:
    """Starlette's own 404 / 405 (unknown path, wrong method), in OpenAI's shape."""
    http = cast(HTTPException, exc)  # registered for HTTPException only
    return APIError(http.status_code, str(http.detail), headers=http.headers).response()
