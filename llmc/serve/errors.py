"""Every failure leaves the server as an OpenAI error body `{"error": {message, type, param, code}}`.

400: a bad request (our `InputError`/`LimitError`, malformed JSON, wrong types: vLLM answers 400 for these too);
401: no or a wrong API key; 404: unknown model; 413: a body over the limit; 429/503 with Retry-After: overloaded /
shutting down; 500: the engine failed, or a fault (named by the request id in the server log).
"""

from __future__ import annotations

import logging
import math

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from llmc.errors import InputError
from llmc.runtime.async_engine import OverloadedError, ShuttingDownError
from llmc.serve.protocol import BadBody, ErrorInfo, ErrorResponse, TooDeep

log = logging.getLogger("llmc.serve")

_TYPES = {400: "invalid_request_error", 401: "invalid_request_error", 404: "not_found_error",
          413: "invalid_request_error", 429: "rate_limit_error", 500: "server_error", 503: "service_unavailable"}


class ApiError(Exception):
    """An error with the HTTP status and OpenAI fields it leaves the server with."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 retry_after: float | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.retry_after = retry_after


def error_body(status: int, message: str, param: str | None = None, code: str | None = None) -> dict[str, object]:
    info = ErrorInfo(message=message, type=_TYPES.get(status, "invalid_request_error"), param=param, code=code)
    return ErrorResponse(error=info).model_dump()


def to_api_error(exc: Exception, request_id: str | None = None) -> ApiError:
    """Map a runtime error to its status; an `InputError` names its field (`param`)."""
    if isinstance(exc, ApiError):
        return exc
    if isinstance(exc, ShuttingDownError):
        return ApiError(503, str(exc), code="shutting_down", retry_after=exc.retry_after)
    if isinstance(exc, OverloadedError):
        return ApiError(429, str(exc), code="overloaded", retry_after=exc.retry_after)
    if isinstance(exc, InputError):
        return ApiError(400, str(exc), param=exc.param)
    log.error("request %s: internal error: %r", request_id, exc, exc_info=exc)
    return ApiError(500, f"internal error: {type(exc).__name__} (request id {request_id}; see the server log)",
                    code="internal_error")


def error_response(exc: Exception, request_id: str | None = None) -> JSONResponse:
    err = to_api_error(exc, request_id)
    headers = {"Retry-After": str(max(1, math.ceil(err.retry_after)))} if err.retry_after is not None else None
    return JSONResponse(error_body(err.status, err.message, err.param, err.code), status_code=err.status,
                        headers=headers)


def _validation_message(exc: RequestValidationError, content_type: str | None) -> tuple[str, str | None]:
    """One line naming the first bad field by its path, e.g. `body.messages.0.role: Field required`."""
    errors = exc.errors()
    if not errors:
        return "invalid request", None
    first = errors[0]
    cause = first.get("ctx", {}).get("error")
    if isinstance(cause, BadBody):
        return str(cause), (cause.path[0] if cause.path else None)
    loc = [str(p) for p in first.get("loc", ())]
    if loc == ["body"] and isinstance(first.get("input"), bytes):  # FastAPI reads JSON under a JSON type only
        return f"the body is read as JSON only with Content-Type: application/json, got {content_type!r}", None
    if first.get("type") == "json_invalid":
        where = f" at character {loc[-1]}" if len(loc) > 1 else ""
        return f"malformed JSON body: {first.get('msg')}{where}", None
    path = ".".join(loc)
    field = [p for p in loc[1:] if not p.isdigit()]
    more = f" (and {len(errors) - 1} more)" if len(errors) > 1 else ""
    return f"{path}: {first.get('msg')}{more}", (field[0] if field else None)


def _http_message(exc: StarletteHTTPException) -> str:
    """The detail; for FastAPI's "There was an error parsing the body" (JSON that Python's json module refused,
    not for its syntax), what it refused."""
    cause = exc.__cause__
    if isinstance(cause, RecursionError):
        return str(TooDeep([]))
    if exc.status_code == 400 and isinstance(cause, ValueError):  # not UTF-8; an integer over 4300 digits
        return f"malformed JSON body: {str(cause).partition(';')[0]}"
    return str(exc.detail)


def install_error_handlers(app: FastAPI) -> None:
    async def on_validation(request: Request, exc: RequestValidationError) -> JSONResponse:
        message, param = _validation_message(exc, request.headers.get("content-type"))
        return JSONResponse(error_body(400, message, param), status_code=400)

    async def on_http(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        return JSONResponse(error_body(exc.status_code, _http_message(exc)), status_code=exc.status_code,
                            headers=exc.headers)

    async def on_error(request: Request, exc: Exception) -> JSONResponse:
        return error_response(exc, request_id(request))

    app.add_exception_handler(RequestValidationError, on_validation)  # type: ignore[arg-type]
    app.add_exception_handler(StarletteHTTPException, on_http)  # type: ignore[arg-type]
    app.add_exception_handler(ApiError, on_error)
    app.add_exception_handler(InputError, on_error)
    app.add_exception_handler(OverloadedError, on_error)


def request_id(request: Request) -> str | None:
    """The id the guard gave this request (`llmc.serve.middleware`)."""
    return getattr(request.state, "request_id", None)
