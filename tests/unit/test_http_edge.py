"""The HTTP server's own edge (``deployments/proxy_edge.py``) on a real uvicorn server, both of its HTTP
implementations, over raw sockets: read timeouts, the connection bound, OpenAI-shaped answers to
what does not parse as HTTP, and that none of it cuts a kept-alive connection or a long stream.
(tests/cluster/serve_app/test_app_basics.py checks that Serve's proxy installs it.)"""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time

import pytest
import uvicorn

from deployments import proxy_edge
from specdec_bench.local_app import free_port

TIMEOUT_S = 0.5


async def app(scope, receive, send):
    """/stream answers for 3 timeouts' worth of time after its body; anything else echoes its body (read
    whole by ``BufferedBodyMiddleware`` where it could, as the router takes it)."""
    body = scope.pop(proxy_edge.BUFFERED_BODY, b"")
    while True:
        message = await receive()
        body += message.get("body", b"")
        if not message.get("more_body"):
            break
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/plain")]})
    if scope["path"] == "/stream":
        for _ in range(6):
            await asyncio.sleep(TIMEOUT_S / 2)
            await send({"type": "http.response.body", "body": b"tick ", "more_body": True})
    await send({"type": "http.response.body", "body": body or b"ok"})


@pytest.fixture(params=["h11", "httptools"])
def port(request, monkeypatch):
    monkeypatch.setattr(proxy_edge, "HEADER_TIMEOUT_S", TIMEOUT_S)
    monkeypatch.setattr(proxy_edge, "MAX_CONNECTIONS", 3)
    proxy_edge.guard_http_server()
    port = free_port()
    # as middlewares() composes them
    edge = proxy_edge.BodyTimeoutMiddleware(proxy_edge.BufferedBodyMiddleware(app), timeout_s=TIMEOUT_S)
    config = uvicorn.Config(edge, host="127.0.0.1", port=port,
                            http=request.param, lifespan="off", log_level="critical", access_log=False)
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started and time.monotonic() < deadline:
        time.sleep(0.02)
    yield port
    server.should_exit = True
    thread.join(timeout=10)


def connect(port: int) -> socket.socket:
    return socket.create_connection(("127.0.0.1", port), timeout=10)


def read_all(s: socket.socket) -> bytes:
    """Everything until the server closes the connection."""
    out = b""
    while chunk := s.recv(65536):
        out += chunk
    return out


def error_of(answer: bytes, status: int) -> dict:
    head, _, body = answer.partition(b"\r\n\r\n")
    assert head.startswith(f"HTTP/1.1 {status}".encode()), answer
    assert b"content-type: application/json" in head.lower()
    error = json.loads(body)["error"]
    assert set(error) == {"message", "type", "param", "code"}
    return error


def request(path: str = "/", body: bytes = b"") -> bytes:
    return (f"POST {path} HTTP/1.1\r\nHost: edge\r\nContent-Length: {len(body)}\r\n\r\n").encode() + body


def test_half_sent_headers_get_a_408_and_the_connection_closes(port):
    with connect(port) as s:
        s.sendall(b"POST / HTTP/1.1\r\nHost: edge\r\n")
        t0 = time.monotonic()
        answer = read_all(s)
    assert time.monotonic() - t0 < 5 * TIMEOUT_S
    assert error_of(answer, 408)["code"] == "header_timeout"


def test_a_connection_that_sends_nothing_is_closed_silently(port):
    with connect(port) as s:
        assert read_all(s) == b""


@pytest.mark.parametrize("raw", [
    b"\x16\x03\x01\x00\xa5\x01\x00\x00\xa1\x03\x03" + bytes(32),  # a TLS ClientHello on the plain port
    b"POST / HTTP/1.1\r\nHost: edge\r\nContent-Length: -1\r\n\r\n",
    b"POST / HTTP/1.1\r\nHost: edge\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\nxx\r\n",
])
def test_what_does_not_parse_as_http_gets_an_openai_shaped_400(port, raw):
    with connect(port) as s:
        s.sendall(raw)
        assert error_of(read_all(s), 400)["code"] == "invalid_http"


def test_a_stalled_body_gets_a_408(port):
    with connect(port) as s:
        s.sendall(b"POST / HTTP/1.1\r\nHost: edge\r\nContent-Length: 100\r\n\r\n0123456789")
        assert error_of(read_all(s), 408)["code"] == "body_timeout"


def test_past_the_bound_a_new_connection_gets_a_503_with_retry_after(port):
    held = [connect(port) for _ in range(3)]
    try:
        time.sleep(0.1)
        with connect(port) as s:
            answer = read_all(s)
        assert error_of(answer, 503)["code"] == "too_many_connections" and b"retry-after: 1" in answer
    finally:
        for s in held:
            s.close()
    time.sleep(0.1)
    with connect(port) as s:  # below the bound again
        s.sendall(request(body=b"hi"))
        assert s.recv(65536).startswith(b"HTTP/1.1 200")


def test_a_kept_alive_connection_and_a_long_stream_outlive_the_timeouts(port):
    with connect(port) as s:
        s.sendall(request(body=b"first"))
        answer = s.recv(65536)
        assert answer.startswith(b"HTTP/1.1 200") and b"\r\nfirst\r\n" in answer, answer  # the body, read at the edge
        time.sleep(3 * TIMEOUT_S)  # idle between requests: the server's keep-alive applies, not ours
        s.sendall(request("/stream"))
        got = b""
        while not got.endswith(b"0\r\n\r\n") and (chunk := s.recv(65536)):  # the last chunk
            got += chunk
    assert got.startswith(b"HTTP/1.1 200") and got.count(b"tick") == 6, got
