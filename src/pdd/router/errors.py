"""OpenAI-shaped errors: ``{"error": {"message", "type", "param", "code"}}`` with a proper status.

Every failure the HTTP layer can produce goes through here, including FastAPI's own 422 and
Starlette's 404/405, so clients (the ``openai`` package among them) always get the shape they parse.
Messages never include request content: a prompt must not leak into logs or error bodies.
"""

from __future__ import annotations

import math
import re
import traceback
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from pdd.router.types import GenerationError
from pdd.shared.telemetry import get_logger

log = get_logger("pdd.router.api")

_STATUS_CODES = {
    400: "invalid_request_error",
    401: "invalid_api_key",
    403: "forbidden",
    404: "not_found",
    405: "method_not_allowed",
    413: "request_too_large",
    429: "rate_limit_exceeded",
    503: "service_unavailable",
    504: "timeout",
}


class APIError(Exception):
    """A request-level failure that becomes one OpenAI-shaped error response."""

    def __init__(self, status: int, message: str, code: str | None = None, param: str | None = None,
                 type_: str | None = None, retry_after_s: float | None = None):
        super().__init__(message)
        self.retry_after_s = retry_after_s
        self.status = status
        self.message = message
        self.code = code or _STATUS_CODES.get(status, "error")
        self.param = param
        self.type = type_ or ("invalid_request_error" if status < 500 else "server_error")

    @classmethod
    def from_generation_error(cls, err: GenerationError) -> "APIError":
        status = err.http_status if 400 <= err.http_status <= 599 else 500
        return cls(status, err.message, code=err.code, retry_after_s=err.retry_after_s)

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        headers = {"WWW-Authenticate": "Bearer"} if self.status == 401 else {}
        if self.retry_after_s is not None:
            headers["Retry-After"] = str(max(1, math.ceil(self.retry_after_s)))
        return JSONResponse(self.body(), status_code=self.status, headers=headers or None)


_UNION_TAG = re.compile(r"[\[\]\-]|^(str|int|float|bool|list|dict|none|literal)$")

# What a field that accepts several shapes expects, for messages clearer than pydantic's per-member ones.
_EXPECTED = {
    "prompt": "a string, or a list of token ids (non-negative integers)",
    "stop": "a string or a list of strings",
    "content": "a string or a list of text parts ({\"type\": \"text\", \"text\": ...})",
}


def _param(loc: tuple[Any, ...]) -> tuple[str, bool]:
    """Dotted field path of a pydantic error, cut at the first union-member tag pydantic inserts;
    the flag says whether the path went through a union."""
    parts: list[str] = []
    for p in loc:
        if p == "body" and not parts:
            continue
        if isinstance(p, str) and _UNION_TAG.search(p):
            return ".".join(parts), True
        parts.append(str(p))
    return ".".join(parts), False


def from_validation_error(exc: ValidationError | RequestValidationError) -> APIError:
    """One 400 naming the first bad field (pydantic's ``input`` is left out: it may be the prompt)."""
    errors = exc.errors()
    if not errors:
        return APIError(400, "invalid request body")
    first = errors[0]
    kind = first.get("type")
    if kind == "json_invalid":
        return APIError(400, "request body is not valid JSON", code="invalid_json")
    param, via_union = _param(tuple(first.get("loc", ())))
    if not param and kind in ("model_type", "model_attributes_type", "dict_type"):
        return APIError(400, "request body must be a JSON object")
    if via_union:
        msg = "has the wrong type; expected " + _EXPECTED.get(param.rsplit(".", 1)[-1], "a different type")
    elif kind == "missing":
        msg = "field required"
    elif kind in ("model_type", "model_attributes_type", "dict_type"):
        msg = "expected a JSON object"
    else:
        msg = str(first.get("msg", "invalid value")).removeprefix("Value error, ")
    return APIError(400, f"'{param}': {msg}" if param else msg, param=param or None)


def install_error_handlers(app: FastAPI) -> None:
    """Route every error path, FastAPI's and Starlette's included, into the OpenAI shape."""

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> JSONResponse:
        if exc.status >= 500:
            log.warning("request_failed", path=request.url.path, status=exc.status, code=exc.code)
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError) -> JSONResponse:
        return from_validation_error(exc).response()

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        status = exc.status_code if 400 <= exc.status_code <= 599 else 500
        return APIError(status, str(exc.detail)).response()

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        # Frames only: the exception's message could quote request content (a prompt).
        log.error("unhandled_error", path=request.url.path, error_type=type(exc).__name__,
                  frames="".join(traceback.format_tb(exc.__traceback__)))
        return APIError(500, "internal server error", code="internal_error").response()
