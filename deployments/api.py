"""The HTTP edge of the router: the FastAPI app, OpenAI-shaped errors, and the checks that run
before a request body is read.

Every answer carries one ``x-request-id`` header, an id the server made (Serve's HTTP server adds it
and this app adopts it; a client's own id is logged beside it, ``deployments/proxy_edge.py``).
Every error, whatever raised it (our validation, pydantic, a body that does not parse, an unknown
path or method, a failure inside the stack), is OpenAI's body
``{"error": {"message", "type", "param", "code"}}`` with a generic message that names the request id;
tracebacks, file paths, pids, actor ids and addresses go to the server log only,
under the same id. ``EdgeMiddleware`` (pure ASGI, so it runs before the body is read) answers 413
for a body over ``max_body_bytes``, 431 for headers over ``max_header_bytes`` and 401 for a /v1
call (or the API docs) without the configured API key. Every 503 carries ``Retry-After``; no path
answers a redirect.
"""

from __future__ import annotations

import contextvars
import hmac
import json
import logging
import re
import uuid
from dataclasses import dataclass

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from deployments import schemas
from deployments.proxy_edge import BUFFERED_BODY, CLIENT_REQUEST_ID

logger = logging.getLogger("ray.serve")


class APIError(Exception):
    def __init__(self, status: int, message: str, type_: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None, headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code
        self.headers = headers


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, "invalid_request_error", param, code)


def internal_error_message(request_id: str) -> str:
    """What a client learns of a failure inside the stack; the log has the rest under this id."""
    return f"the server failed to process the request (request id {request_id})"


@dataclass
class EdgeLimits:
    """The edge's settings; the Router sets them from its config when it starts (``configure``)."""

    max_body_bytes: int = 1 << 20
    max_header_bytes: int = 32 << 10
    api_key: str | None = None


LIMITS = EdgeLimits()


def configure(max_body_bytes: int, max_header_bytes: int, api_key: str | None) -> None:
    LIMITS.max_body_bytes, LIMITS.max_header_bytes, LIMITS.api_key = max_body_bytes, max_header_bytes, api_key


RETRY_AFTER_S = 1  # a 503 that names no better time (overload): a client may retry in a second
# Behind the API key when one is set: the API and its generated docs (which describe every endpoint).
PROTECTED_PREFIXES = ("/v1", "/docs", "/redoc", "/openapi.json")

_REQUEST_ID: contextvars.ContextVar[str | None] = contextvars.ContextVar("request_id", default=None)


def current_request_id() -> str:
    """The id ``EdgeMiddleware`` gave the HTTP request this task serves (a fresh one outside HTTP)."""
    return _REQUEST_ID.get() or uuid.uuid4().hex


def request_id_of(request: Request) -> str:
    return request.scope.get("state", {}).get("request_id") or current_request_id()


def new_request_id(scope) -> tuple[str, bool]:
    """The request's id and whether this app must send it: behind Serve's HTTP server, its
    ``RequestIdMiddleware`` has put the id (server-made: ``deployments/proxy_edge.py`` moved a
    client's aside) in the request headers and adds it to the response itself, so one answer carries
    one id; on its own, this app makes one."""
    given = dict(scope.get("headers", [])).get(b"x-request-id")
    rid = given.decode("latin-1") if given else uuid.uuid4().hex
    scope.setdefault("state", {})["request_id"] = rid
    _REQUEST_ID.set(rid)
    return rid, not given


def _error_response(status: int, message: str, type_: str, param=None, code=None,
                    headers: dict | None = None) -> JSONResponse:
    """The middleware adds the x-request-id header to every answer, these included. Every 503 says
    when to retry (``Retry-After``: the raiser's, else ``RETRY_AFTER_S``)."""
    if status == 503:
        headers = {"Retry-After": str(RETRY_AFTER_S), **(headers or {})}
    return JSONResponse(schemas.error_body(message, type_, param, code), status_code=status, headers=headers)


class EdgeMiddleware:
    """Request id, header and body size limits, API key: all decided from the ASGI scope and the
    body's chunks as they arrive, so an oversized or unauthorised request costs no parse."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        rid, send_id = new_request_id(scope)
        client_id = dict(scope.get("headers", [])).get(CLIENT_REQUEST_ID)
        if client_id:
            logger.info("request %s: client request id %r", rid, client_id[:128].decode("latin-1"))

        async def send_with_id(message):
            if message["type"] == "http.response.start" and send_id:
                message["headers"] = list(message.get("headers", [])) + [(b"x-request-id", rid.encode())]
            await send(message)

        refusal = self._refusal(scope)
        if refusal is not None:
            logger.info("request %s refused at the edge: %s %s", rid, refusal[0], refusal[1])
            return await _error_response(*refusal)(scope, receive, send_with_id)
        received = 0
        # A body read whole at the proxy (deployments/proxy_edge.py). What ``receive`` gives after it (the
        # proxy's empty stand-in, then the disconnect) only reaches a disconnect listener, which ignores
        # all but the disconnect.
        buffered = scope.pop(BUFFERED_BODY, None)

        async def counting_receive():
            nonlocal received, buffered
            if buffered is not None:
                message, buffered = {"type": "http.request", "body": buffered, "more_body": False}, None
            else:
                message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > LIMITS.max_body_bytes:  # a chunked body without content-length
                    scope["state"]["body_too_large"] = True
                    raise _BodyTooLarge
            return message

        try:
            await self.app(scope, counting_receive, send_with_id)
        except _BodyTooLarge:
            await _error_response(*_too_large())(scope, receive, send_with_id)

    @staticmethod
    def _refusal(scope) -> tuple | None:
        """(status, message, type, param, code) of a request refused before its body is read."""
        headers = scope.get("headers", [])
        if sum(len(k) + len(v) for k, v in headers) > LIMITS.max_header_bytes:
            return (431, f"request headers exceed {LIMITS.max_header_bytes} bytes", "invalid_request_error", None,
                    "headers_too_large")
        values = {k.lower(): v for k, v in headers}
        length = values.get(b"content-length")
        if length is not None and (not length.isdigit() or int(length) > LIMITS.max_body_bytes):
            return _too_large()
        if LIMITS.api_key and scope.get("path", "").startswith(PROTECTED_PREFIXES):
            given = values.get(b"authorization", b"")
            if not hmac.compare_digest(given, f"Bearer {LIMITS.api_key}".encode()):
                return (401, "invalid or missing API key (Authorization: Bearer <key>)", "invalid_request_error",
                        None, "invalid_api_key")
        return None


class _BodyTooLarge(Exception):
    """A chunked body passed the limit while it was being read."""


def _too_large() -> tuple:
    return (413, f"request body exceeds {LIMITS.max_body_bytes} bytes", "invalid_request_error", None,
            "body_too_large")


# No trailing-slash redirects: Starlette's answer a 307 to an absolute URL built from the request's Host
# header, which a client controls; "/v1/models/" gets the OpenAI-shaped 404 instead.
app = FastAPI(title="specdec-serve", description="OpenAI-compatible speculative decoding service",
              redirect_slashes=False)
app.add_middleware(EdgeMiddleware)


@app.exception_handler(APIError)
async def _api_error(request: Request, exc: APIError):
    return _error_response(exc.status, exc.message, exc.type, exc.param, exc.code, exc.headers)


_FIELD_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_TYPE_TAGS = {"str", "int", "float", "bool", "list", "dict", "none", "TextPart"}


def public_param(loc) -> str | None:
    """A validation error's location as the request's own field path (``messages[0].content``): without
    pydantic's union-member and validator tags (``function-after[_utf8(), constrained-str]``, ``list[int]``)."""
    path = ""
    for part in loc:
        if isinstance(part, int):
            path += f"[{part}]"
        elif part != "body" and _FIELD_NAME.fullmatch(part) and part not in _TYPE_TAGS:
            path += f".{part}" if path else part
    return path or None


@app.exception_handler(RequestValidationError)
async def _validation_error(request: Request, exc: RequestValidationError):
    errors = exc.errors()
    # A union field fails once per member: the member that got deepest into the value says most.
    deepest = max(errors, key=lambda e: len(public_param(e.get("loc", ())) or ""), default={})
    # pydantic's own message per field, never the input value (it may be huge or hostile)
    message = "; ".join(f"{public_param(e.get('loc', ())) or 'body'}: {e.get('msg')}" for e in errors[:5])
    return _error_response(400, message or "invalid request", "invalid_request_error",
                           public_param(deepest.get("loc", ())), "invalid_value")


@app.exception_handler(StarletteHTTPException)
async def _http_error(request: Request, exc: StarletteHTTPException):
    """404, 405, and bodies that do not parse (FastAPI raises 400 for those, also for a chunked body
    that ``EdgeMiddleware`` cut off at the size limit)."""
    if request.scope.get("state", {}).get("body_too_large"):
        return _error_response(*_too_large())
    messages = {400: "the request body is not valid JSON", 404: f"no such endpoint: {request.url.path}",
                405: f"method {request.method} is not allowed on {request.url.path}"}
    message = messages.get(exc.status_code, "the request could not be served")
    return _error_response(exc.status_code, message, "invalid_request_error", None, None,
                           headers=dict(exc.headers or {}))


@app.exception_handler(Exception)
async def _unexpected(request: Request, exc: Exception):
    rid = request_id_of(request)
    logger.error("request %s failed", rid, exc_info=exc)
    return _error_response(500, internal_error_message(rid), "server_error")


def sse_event(obj: dict) -> str:
    return f"data: {json.dumps(obj, separators=(',', ':'))}\n\n"
