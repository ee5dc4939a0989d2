"""The router's HTTP edge (``deployments/api.py``) on its own ASGI app, through httpx's ASGI
transport: checks that run before a body is read (size limits, API key) and the OpenAI error shape
of 404/405. The served app runs the same middleware (tests/test_serve_app.py covers it there)."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from deployments import api


@api.app.post("/v1/test-echo")
async def _echo(body: dict) -> dict:  # a route that reads its body, as the real endpoints do
    return body


@pytest.fixture
def edge():
    api.configure(max_body_bytes=4096, max_header_bytes=2048, api_key="sekrit")
    yield
    api.configure(**{f: getattr(api.EdgeLimits(), f) for f in ("max_body_bytes", "max_header_bytes", "api_key")})


def call(method: str, path: str, **kw) -> httpx.Response:
    async def go():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=api.app), base_url="http://edge") as c:
            return await c.request(method, path, **kw)
    return asyncio.run(go())


def assert_openai_error(r: httpx.Response, status: int, code: str | None = None) -> None:
    assert r.status_code == status, r.text
    assert set(r.json()["error"]) == {"message", "type", "param", "code"}
    assert r.headers["x-request-id"]
    if code is not None:
        assert r.json()["error"]["code"] == code


def test_api_key_guards_v1_only(edge):
    # Paths no route serves (the Router's own routes need a Serve replica to run): the edge answers
    # before routing, so the key is checked first and a passed request ends in the 404 handler.
    assert_openai_error(call("GET", "/v1/edge-test"), 401, "invalid_api_key")
    assert_openai_error(call("GET", "/v1/edge-test", headers={"Authorization": "Bearer wrong"}), 401)
    assert_openai_error(call("GET", "/v1/edge-test", headers={"Authorization": "Bearer sekrit"}), 404)
    assert_openai_error(call("GET", "/edge-test"), 404)  # outside /v1: not behind the key


def test_body_and_header_limits(edge):
    auth = {"Authorization": "Bearer sekrit"}
    assert call("POST", "/v1/test-echo", json={"a": 1}, headers=auth).json() == {"a": 1}
    assert_openai_error(call("POST", "/v1/test-echo", content=b"x" * 5000, headers=auth), 413, "body_too_large")

    async def chunked():  # no content-length: counted while read
        for _ in range(10):
            yield b"x" * 1000

    assert_openai_error(call("POST", "/v1/test-echo", content=chunked(), headers=auth), 413, "body_too_large")
    assert_openai_error(call("GET", "/v1/edge-test", headers={**auth, "x-big": "y" * 3000}), 431, "headers_too_large")


def test_unknown_path_and_method_are_openai_shaped():
    assert_openai_error(call("GET", "/nope"), 404)
    assert_openai_error(call("GET", "/v1/test-echo"), 405)
    assert_openai_error(call("POST", "/v1/test-echo", content=b"{not json"), 400)
    assert_openai_error(call("POST", "/v1/test-echo", content=b"[" * 100000), 400)
