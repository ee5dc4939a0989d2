"""Middleware for Serve's HTTP proxy (and direct ingress): the server's request id, not the client's.

Serve's own ``RequestIdMiddleware`` takes a client's ``x-request-id`` as the request's id (its
access log, the replica's request context, the response header). A client could then give many
requests one id, or another client's. This middleware runs before it (Serve wraps its own innermost)
and moves a client's id to ``x-client-request-id``, so every request gets an id the server made;
the router logs the client's beside it (``deployments/api.py``).

Serve loads it from ``RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH=deployments.proxy_edge:middlewares``
(read by the proxy processes when the cluster starts: ``./run`` exports it; SECURITY.md).
"""

from __future__ import annotations

from starlette.middleware import Middleware

CLIENT_REQUEST_ID = b"x-client-request-id"


class ClientRequestIdMiddleware:
    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http":
            scope["headers"] = [(CLIENT_REQUEST_ID if k.lower() == b"x-request-id" else k, v)
                                for k, v in scope.get("headers", [])]
        await self.app(scope, receive, send)


def middlewares() -> list[Middleware]:
    return [Middleware(ClientRequestIdMiddleware)]
