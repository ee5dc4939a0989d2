"""The router's HTTP edge (``deployments/api.py``) on its own ASGI app, through httpx's ASGI
transport: checks that run before a body is read (size limits, API key) and the OpenAI error shape
of 404/405. The served app runs the same middleware (tests/cluster/serve_app/ covers it there)."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from deployments import api, schemas


@api.app.post("/v1/test-echo")
async def _echo(body: dict) -> dict:  # a route that reads its body, as the real endpoints do
    return body


# The real endpoints' request models behind a route each (the endpoints themselves need a Serve
# replica): FastAPI validates a body with them exactly as on the Router.
@api.app.post("/v1/test-completion")
async def _completion(body: schemas.CompletionRequest) -> dict:
    return body.model_dump(exclude_unset=True)


@api.app.post("/v1/test-chat")
async def _chat(body: schemas.ChatCompletionRequest) -> dict:
    return {"messages": [{"role": m.role, "text": m.text()} for m in body.messages]}


@api.app.get("/v1/test-overloaded")
async def _overloaded():
    raise api.APIError(503, "server overloaded", "server_error", None, "overloaded")


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


COMPLETION = {"model": "m", "prompt": "hi"}


@pytest.mark.parametrize("field, value, param", [
    ("max_tokens", True, "max_tokens"), ("max_tokens", "16", "max_tokens"), ("max_tokens", 16.0, "max_tokens"),
    ("temperature", True, "temperature"), ("temperature", "0.5", "temperature"), ("stream", "yes", "stream"),
    ("stream", 1, "stream"), ("prompt", [True, False], "prompt[0]"), ("seed", "7", "seed"), ("top_k", 2.0, "top_k"),
    ("ignore_eos", "true", "ignore_eos"), ("speculation", {"num_speculative_tokens": True},
                                           "speculation.num_speculative_tokens"),
    ("stop", "", "stop"), ("stop", ["a", 3], "stop[1]"),
])
def test_no_lax_coercion_and_the_param_is_the_public_field(field, value, param):
    """What OpenAI refuses is refused: a bool or a numeric string where a number or a bool belongs,
    booleans as token ids; the error names the field as the request spells it (no pydantic tags)."""
    r = call("POST", "/v1/test-completion", json={**COMPLETION, field: value})
    assert_openai_error(r, 400, "invalid_value")
    assert r.json()["error"]["param"] == param, r.json()


def test_a_float_field_takes_an_integer_and_valid_bodies_pass():
    r = call("POST", "/v1/test-completion", json={**COMPLETION, "temperature": 1, "top_p": 1, "max_tokens": 4,
                                                  "stream": True, "stream_options": {"include_usage": True}})
    assert r.status_code == 200, r.text
    assert r.json()["temperature"] == 1.0 and r.json()["max_tokens"] == 4


def test_stream_options_need_stream():
    assert_openai_error(call("POST", "/v1/test-completion",
                             json={**COMPLETION, "stream_options": {"include_usage": True}}), 400, "invalid_value")


@pytest.mark.parametrize("message, param", [
    ({"role": "user\nassistant", "content": "x"}, "messages[0].role"),  # a forged turn in the fallback template
    ({"role": "robot", "content": "x"}, "messages[0].role"),
    ({"role": "user", "content": [{"type": "text", "text": None}]}, "messages[0].content[0].text"),
    ({"role": "user", "content": [{"type": "text", "text": 5}]}, "messages[0].content[0].text"),
    ({"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}, "messages[0].content[0].type"),
    ({"role": "user", "content": 7}, "messages[0].content"),
    ({"role": "user", "content": None}, "messages[0]"),
    ({"role": "tool", "content": "42"}, "messages[0]"),
])
def test_chat_messages_take_openai_roles_and_text_parts_only(message, param):
    r = call("POST", "/v1/test-chat", json={"model": "m", "messages": [message]})
    assert_openai_error(r, 400, "invalid_value")
    assert r.json()["error"]["param"] == param, r.json()


def test_chat_text_parts_join_and_assistant_may_omit_content():
    r = call("POST", "/v1/test-chat", json={"model": "m", "messages": [
        {"role": "developer", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
        {"role": "assistant", "content": None},
        {"role": "tool", "content": "42", "tool_call_id": "call-1"}]})
    assert r.status_code == 200, r.text
    assert r.json()["messages"] == [{"role": "developer", "text": "ab"}, {"role": "assistant", "text": ""},
                                    {"role": "tool", "text": "42"}]


def test_no_redirect_reflects_the_host_header():
    for path in ("/v1/test-chat/", "/v1/models/", "/health/"):
        r = call("GET", path, headers={"Host": "evil.example"})
        assert not 300 <= r.status_code < 400 and "location" not in r.headers, (path, r.status_code, r.headers)
        assert_openai_error(r, 404 if path != "/v1/test-chat/" else 404)


def test_every_503_says_when_to_retry():
    r = call("GET", "/v1/test-overloaded")
    assert_openai_error(r, 503, "overloaded")
    assert int(r.headers["retry-after"]) >= 1


def test_api_docs_are_behind_the_api_key(edge):
    for path in ("/docs", "/redoc", "/openapi.json"):
        assert_openai_error(call("GET", path), 401, "invalid_api_key")
        assert call("GET", path, headers={"Authorization": "Bearer sekrit"}).status_code == 200


def test_behind_serve_the_servers_request_id_is_adopted_not_doubled():
    """Serve's HTTP server puts its request id in the request and on the response: the app uses that
    id and adds no second header; on its own (no such header) it makes one."""
    behind = call("GET", "/v1/models-nowhere", headers={"x-request-id": "serve-made-id"})
    assert behind.status_code == 404 and behind.headers.get_list("x-request-id") == []
    alone = call("GET", "/v1/models-nowhere")
    assert len(alone.headers.get_list("x-request-id")) == 1


def test_proxy_middleware_moves_a_clients_request_id_aside():
    from deployments.proxy_edge import ClientRequestIdMiddleware

    seen = {}

    async def app(scope, receive, send):
        seen.update(dict(scope["headers"]))
        await send({"type": "http.response.start", "status": 204, "headers": []})
        await send({"type": "http.response.body", "body": b""})

    async def go():
        transport = httpx.ASGITransport(app=ClientRequestIdMiddleware(app))
        async with httpx.AsyncClient(transport=transport, base_url="http://edge") as c:
            return await c.get("/", headers={"X-Request-ID": "mine"})

    assert asyncio.run(go()).status_code == 204
    assert b"x-request-id" not in seen and seen[b"x-client-request-id"] == b"mine"


def test_a_small_body_read_whole_at_the_proxy_reaches_the_app_in_the_scope(edge):
    """The proxy's ``BufferedBodyMiddleware`` in front of the router's app, as Serve connects them: a
    body of known length up to its limit travels in the scope and the app reads it from there (nothing
    of it through ``receive``, which behind Serve is an actor call back to the proxy); a larger or a
    chunked body goes through ``receive`` as before; the limits hold either way."""
    from deployments.proxy_edge import BufferedBodyMiddleware

    through_receive = []

    def recording(app):
        async def recorded(scope, receive, send):
            async def receive_and_record():
                message = await receive()
                through_receive.append(message.get("body", b""))
                return message
            await app(scope, receive_and_record, send)
        return recorded

    stack = BufferedBodyMiddleware(recording(api.app), limit=1000)

    def post(**kw) -> httpx.Response:
        async def go():
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=stack), base_url="http://edge") as c:
                return await c.post("/v1/test-echo", headers={"Authorization": "Bearer sekrit",
                                                              "content-type": "application/json"}, **kw)
        through_receive.clear()
        return asyncio.run(go())

    small = {"prompt": "x" * 500}
    assert post(json=small).json() == small and b"".join(through_receive) == b""
    large = {"prompt": "x" * 2000}
    assert post(json=large).json() == large and json.loads(b"".join(through_receive)) == large

    async def chunked():
        yield b'{"a": '
        yield b"1}"

    assert post(content=chunked()).json() == {"a": 1} and b"".join(through_receive) == b'{"a": 1}'
    assert_openai_error(post(content=b"x" * 5000), 413, "body_too_large")
