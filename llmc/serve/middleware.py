"""The guard every HTTP request passes first: a request id, the API key, the body limit, and a JSON 500.

A pure ASGI middleware (no buffering of streamed responses). In order:
- every request gets an id (the client's `X-Request-Id` when it is short and plain, else a new one), echoed in the
  response's `X-Request-Id` header and named in the server log for any failure;
- with an API key, `/v1/*` (and `/metrics` when asked) need `Authorization: Bearer KEY`, compared in constant time;
  401 in the OpenAI error format otherwise (`/health` and `/version` stay open);
- a body larger than `max_request_bytes` is refused with 413 before it is read (Content-Length) or as soon as
  the bytes read pass the limit (chunked uploads);
- an exception that escapes a route becomes a JSON 500 naming the request id, never Starlette's text page.
"""

from __future__ import annotations

import hmac
import logging
import re
import uuid
from dataclasses import dataclass

from starlette.exceptions import HTTPException
from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from llmc.serve.errors import error_body

log = logging.getLogger("llmc.serve")

_CLIENT_ID = re.compile(r"^[A-Za-z0-9._:-]{1,64}$")


@dataclass(frozen=True)
class GuardConfig:
    api_key: str | None = None
    protect_metrics: bool = False  # /metrics behind the key too
    max_request_bytes: int = 2 * 2**20


class BodyTooLarge(HTTPException):
    """Raised while a body is read, once its bytes pass the limit (FastAPI passes HTTPExceptions through)."""

    def __init__(self, limit: int) -> None:
        super().__init__(413, f"request body is larger than the server's limit of {limit} bytes "
                              "(--max-request-bytes)")


class Guard:
    def __init__(self, app: ASGIApp, config: GuardConfig) -> None:
        self.app = app
        self.config = config
        self._key = config.api_key.encode() if config.api_key else None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        rid = _request_id(headers.get("x-request-id"))
        scope.setdefault("state", {})["request_id"] = rid
        started = False

        async def send_with_id(message: Message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
                message = {**message, "headers": [*message.get("headers", []), (b"x-request-id", rid.encode())]}
            await send(message)

        refusal = self._refusal(scope["path"], headers)
        if refusal is not None:
            await refusal(scope, receive, send_with_id)
            return
        try:
            await self.app(scope, self._limited(receive), send_with_id)
        except Exception as e:
            log.exception("request %s (%s %s) failed", rid, scope.get("method"), scope["path"])
            if not started:
                message = f"internal error: {type(e).__name__} (request id {rid}; see the server log)"
                await _json(500, message, code="internal_error")(scope, receive, send_with_id)

    def _refusal(self, path: str, headers: dict[str, str]) -> JSONResponse | None:
        """The answer to a request refused before it runs, if it is."""
        if self._key is not None and (path.startswith("/v1/") or (path == "/metrics" and
                                                                  self.config.protect_metrics)):
            given = headers.get("authorization", "")
            scheme, _, token = given.partition(" ")
            if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), self._key):
                what = "no API key given" if not given else "the API key is not valid"
                return _json(401, f"{what}: send 'Authorization: Bearer KEY' with the server's --api-key",
                             code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})
        length = headers.get("content-length", "")
        limit = self.config.max_request_bytes
        if length.isdigit() and int(length) > limit:
            return _json(413, f"request body of {int(length)} bytes is larger than the server's limit of {limit} "
                              "bytes (--max-request-bytes)", code="request_too_large")
        return None

    def _limited(self, receive: Receive) -> Receive:
        """`receive`, raising `BodyTooLarge` once the body read passes the limit."""
        limit, seen = self.config.max_request_bytes, 0

        async def wrapped() -> Message:
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > limit:
                    raise BodyTooLarge(limit)
            return message

        return wrapped


def _request_id(given: str | None) -> str:
    return given if given and _CLIENT_ID.match(given) else f"req-{uuid.uuid4().hex[:20]}"


def _json(status: int, message: str, code: str, headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse(error_body(status, message, code=code), status_code=status, headers=headers)
