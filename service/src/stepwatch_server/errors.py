"""One error hierarchy for the API, and the one handler that renders it.

Every error answer has the same shape: `{"error": {"code": ..., "field": ..., "message": ...}}`,
where `field` is the path of the offending field in the request (or null) and `message` names the
field and the problem, so that a client author can fix the request from the answer alone.
"""

from __future__ import annotations

import logging
import re
from typing import Any

import sqlalchemy.exc
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from pydantic import BaseModel
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import Response

from stepwatch_server.responses import json_response

log = logging.getLogger("stepwatch_server")


class ApiError(Exception):
    """An error with an HTTP status, a stable machine-readable code and a human message."""

    status: int = 400
    code: str = "bad_request"

    def __init__(
        self, message: str, *, field: str | None = None, code: str | None = None, status: int | None = None
    ) -> None:
        super().__init__(message)
        self.message = message
        self.field = field
        if code is not None:
            self.code = code
        if status is not None:
            self.status = status


class BadRequest(ApiError):
    status = 400
    code = "bad_request"


class Unauthorized(ApiError):
    status = 401
    code = "unauthorized"


class Forbidden(ApiError):
    """A known token whose scope does not cover what was asked; the message says which scope would."""

    status = 403
    code = "forbidden"


class NotFound(ApiError):
    status = 404
    code = "not_found"


class PayloadTooLarge(ApiError):
    status = 413
    code = "too_large"


class UnsupportedMediaType(ApiError):
    status = 415
    code = "unsupported_media_type"


class InvalidBatch(ApiError):
    """The body parsed but a field is wrong: 422, naming the field path."""

    status = 422
    code = "invalid_field"


class InvalidParameter(ApiError):
    """A query or path parameter is wrong: 422, naming the parameter."""

    status = 422
    code = "invalid_parameter"


class ServiceUnavailable(ApiError):
    status = 503
    code = "unavailable"


class DetectionBehind(ApiError):
    """Ingest refuses a batch while the detection queue is full (detect/worker.py): stored, it would not
    be detected. Answered with `Retry-After`."""

    status = 429
    code = "detection_behind"
    retry_after_s = 2


class ErrorDetail(BaseModel):
    code: str
    field: str | None
    message: str


class ErrorAnswer(BaseModel):
    """Every error answer (OpenAPI)."""

    error: ErrorDetail


def _documented(description: str) -> dict[str, Any]:
    return {"model": ErrorAnswer, "description": description}


# Documented on every route (FastAPI(responses=...)): what any of them can answer besides its own 200.
COMMON_ERRORS: dict[int | str, dict[str, Any]] = {
    422: _documented("A parameter or field is invalid: `field` and `message` say which and why."),
    500: _documented("A bug of ours (`internal_error`): the collector's log has the details."),
    503: _documented("The database is down, full or read-only (`unavailable`), with `Retry-After`."),
}
# Documented on the routes of one run (`/runs/{run}/...`).
RUN_NOT_FOUND: dict[int | str, dict[str, Any]] = {
    404: _documented("No such run, or no such metric or module in it (`not_found`).")
}

DATABASE_RETRY_AFTER_S = 5  # Retry-After of a 503 for an unavailable database
MAX_FIELD_CHARS = 300  # an error's `field`, cut beyond this
MAX_MESSAGE_CHARS = 1_000  # its `message`
_LONG_WORD = re.compile(r"\S{121,}")  # an echoed value (a name, a string) too long to quote whole


def _clip_word(match: re.Match[str]) -> str:
    word = match.group()
    return f"{word[:80]}... ({len(word):,} characters)"


def _clip(text: str, limit: int) -> str:
    """`text` with every run of over 120 non-blank characters cut to its first 80 and its length, and
    at most `limit` characters in all: an error never sends a client's huge input back to it."""
    if len(text) <= 120:
        return text
    text = _LONG_WORD.sub(_clip_word, text)
    return text if len(text) <= limit else f"{text[: limit - 20]}... (cut)"


def _render(
    status: int, code: str, field: str | None, message: str, headers: dict[str, str] | None = None
) -> Response:
    if field is not None:
        field = _clip(field, MAX_FIELD_CHARS)
    body = {"error": {"code": code, "field": field, "message": _clip(message, MAX_MESSAGE_CHARS)}}
    return json_response(body, status=status, headers=headers)


async def _api_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, ApiError)
    headers = {"WWW-Authenticate": "Bearer"} if isinstance(exc, Unauthorized) else None
    if isinstance(exc, DetectionBehind):
        headers = {"Retry-After": str(exc.retry_after_s)}
    return _render(exc.status, exc.code, exc.field, exc.message, headers)


async def _http_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, StarletteHTTPException)
    code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code, "http_error")
    return _render(exc.status_code, code, None, str(exc.detail), dict(exc.headers or {}) or None)


async def _query_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, RequestValidationError)
    errors = exc.errors()
    first = errors[0] if errors else {}
    loc = [str(part) for part in first.get("loc", ()) if part not in ("query", "path", "body")]
    if first.get("type") in ("union_tag_invalid", "union_tag_not_found"):  # a body of several kinds
        loc.append(str(first.get("ctx", {}).get("discriminator", "")).strip("'"))
    field = ".".join(part for part in loc if part) or None
    message = f"{field}: {first.get('msg', 'invalid')}" if field else str(first.get("msg", "invalid"))
    return _render(422, "invalid_parameter", field, message)


async def _database_unavailable(request: Request, exc: Exception) -> Response:
    """The database refused or lost the connection, is full or read-only: nothing was stored, and a
    retry later can work. 503 with Retry-After, so the agent backs off and spools instead of dropping."""
    log.warning("database unavailable on %s %s: %s", request.method, request.url.path, type(exc).__name__)
    message = f"the database is unavailable ({type(exc).__name__}); nothing was stored, retry later"
    return _render(503, "unavailable", None, message, {"Retry-After": str(DATABASE_RETRY_AFTER_S)})


async def _unexpected(request: Request, exc: Exception) -> Response:
    """Anything else is a bug of ours: 500 in the same shape, the details in the server's log (never in
    the answer), so that a client's error path handles it like any other."""
    log.error("unexpected error on %s %s", request.method, request.url.path, exc_info=exc)
    message = "internal error: the collector's log has the details (please report it)"
    return _render(500, "internal_error", None, message)


def install_error_handlers(app: FastAPI) -> None:
    """Route every error the API can produce through the one error shape."""
    app.add_exception_handler(ApiError, _api_error)
    app.add_exception_handler(StarletteHTTPException, _http_error)
    app.add_exception_handler(RequestValidationError, _query_error)
    app.add_exception_handler(sqlalchemy.exc.OperationalError, _database_unavailable)
    app.add_exception_handler(sqlalchemy.exc.TimeoutError, _database_unavailable)  # no pooled connection
    app.add_exception_handler(Exception, _unexpected)
