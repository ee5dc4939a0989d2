"""Errors, overload and disconnects: every bad request gets its 4xx and hurts no one else, overload gets
503, a client that leaves frees everything it held."""

from __future__ import annotations

import asyncio
import re

import httpx
import pytest
from served import COLOCATED, MAX_INFLIGHT, MAX_LEN, PATHS, SEPARATE, complete, sse_events, stats, wait_idle

from specdec_bench import local_app

pytestmark = pytest.mark.timeout(300)


def _assert_error(r, status, param=None):
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    if param is not None:
        assert err["param"] == param, err


def test_errors(client):
    post = lambda body, path="/v1/completions": client.post(path, json={"model": "tiny", **body})
    _assert_error(post({"prompt": "x", "max_tokens": -1}), 400, "max_tokens")
    _assert_error(post({"prompt": "x", "temperature": 3.5}), 400, "temperature")
    _assert_error(post({"prompt": "x", "top_p": 0}), 400, "top_p")
    _assert_error(post({"prompt": "x", "n": 2}), 400, "n")
    _assert_error(post({"prompt": "x", "speculation": {"mode": "turbo"}}), 400, "speculation.mode")
    _assert_error(post({"prompt": "x", "speculation": {"mode": "plain", "topology": "separate"}}), 400,
                  "speculation")
    _assert_error(post({"prompt": "x", "speculation": {"num_speculative_tokens": 99}}), 400)
    _assert_error(post({"prompt": [5, -1, 3]}), 400, "prompt")
    _assert_error(post({"prompt": [5, 10**6]}), 400, "prompt")
    _assert_error(post({"prompt": ""}), 400, "prompt")
    _assert_error(post({"prompt": ["a", "b"]}), 400, "prompt")
    _assert_error(post({"messages": []}, "/v1/chat/completions"), 400, "messages")
    _assert_error(client.post("/v1/completions", content=b"{not json"), 400)
    _assert_error(post({"prompt": "x", "model": "gpt-4"}), 404, "model")
    _assert_error(post({"prompt": [7] * (MAX_LEN + 10)}), 413, "prompt")
    _assert_error(post({"prompt": [7] * 100, "max_tokens": MAX_LEN}), 400, "max_tokens")
    # the server still answers, correctly
    out = complete(client, max_tokens=4)
    assert out["usage"]["completion_tokens"] == 4


INTERNALS = re.compile(r"Traceback|File \"|\.py\b|site-packages|\bpid\b|[Aa]ctor|\b\d{1,3}(\.\d{1,3}){3}\b|"
                       + re.escape(str(local_app.ROOT)))
HOSTILE = [  # (what, request kwargs for client.request, expected status)
    ("top_k 2**64 sampled", {"json": {"prompt": "x", "top_k": 2**64, "temperature": 0.7}}, 400),
    ("top_k past the vocabulary", {"json": {"prompt": "x", "top_k": 10**9, "temperature": 0.7}}, 200),
    ("temperature 1e-300", {"json": {"prompt": "x", "temperature": 1e-300}}, 200),
    ("seed 2**64", {"json": {"prompt": "x", "seed": 2**64, "temperature": 0.7}}, 400),
    ("lone surrogate prompt", {"content": b'{"model": "tiny", "prompt": "a\\ud800b"}'}, 400),
    ("lone surrogate chat", {"content": b'{"model": "tiny", "messages": [{"role": "user", "content": "\\ud800"}]}',
                             "url": "/v1/chat/completions"}, 400),
    ("invalid UTF-8", {"content": b'{"model": "tiny", "prompt": "\xff\xfe"}'}, 400),
    ("empty stop", {"json": {"prompt": "x", "stop": [""]}}, 400),
    ("logit_bias", {"json": {"prompt": "x", "logit_bias": {"5": 10}}}, 400),
    ("tools", {"json": {"messages": [{"role": "user", "content": "hi"}], "tools": [{"type": "function"}]},
               "url": "/v1/chat/completions"}, 400),
    ("presence_penalty", {"json": {"prompt": "x", "presence_penalty": 1.0}}, 400),
    ("deeply nested", {"content": b'{"prompt": ' + b"[" * 50000 + b"]" * 50000 + b"}"}, 400),
    ("unparsable", {"content": b"{not json"}, 400),
    ("GET on a POST endpoint", {"method": "GET"}, 405),
    ("unknown path", {"url": "/v2/nothing", "method": "GET"}, 404),
    ("8 MB body", {"json": {"prompt": "word " * (8 << 18)}}, 413),
    ("64 KB of headers", {"json": {"prompt": "x"}, "headers": {"x-junk": "y" * (64 << 10)}}, 431),
]


def _hostile(client, kw: dict) -> httpx.Response:
    kw = dict(kw)
    method, url = kw.pop("method", "POST"), kw.pop("url", "/v1/completions")
    if "json" in kw:
        kw["json"] = {"model": "tiny", "max_tokens": 4, **kw["json"]}
    if "content" in kw:
        kw["headers"] = {"content-type": "application/json", **kw.get("headers", {})}
    return client.request(method, url, **kw)


def test_hostile_requests_hurt_no_one(server, client):
    """Hostile and malformed requests get a clean, OpenAI-shaped 4xx (or are served, when valid)
    with no internals in the answer, while a greedy stream on every path runs alongside and
    finishes whole with the same text as when served alone; /health keeps answering."""
    body = {"model": "tiny", "prompt": "It is a truth", "max_tokens": 60, "temperature": 0, "ignore_eos": True}
    solo = {name: complete(client, prompt=body["prompt"], max_tokens=60, speculation=spec)["choices"][0]["text"]
            for name, spec in PATHS.items()}

    async def innocent(name):
        async with httpx.AsyncClient(base_url=server["url"], timeout=120) as ac:
            async with ac.stream("POST", "/v1/completions", json={**body, "stream": True,
                                                                  "speculation": PATHS[name]}) as r:
                return sse_events([line async for line in r.aiter_lines()])

    async def scenario():
        streams = [asyncio.create_task(innocent(name)) for name in PATHS]
        answers = []
        for what, kw, _ in HOSTILE:
            answers.append(await asyncio.to_thread(_hostile, client, kw))
            assert (await asyncio.to_thread(client.get, "/health")).status_code == 200, what
        return answers, await asyncio.gather(*streams)

    answers, streams = asyncio.run(scenario())
    for (what, _, status), r in zip(HOSTILE, answers):
        assert r.status_code == status, (what, r.text[:300])
        assert r.headers.get("x-request-id"), what
        assert not INTERNALS.search(r.text), (what, r.text[:300])
        if status != 200:
            err = r.json()["error"]
            assert set(err) == {"message", "type", "param", "code"} and err["message"], what
    for name, events in zip(PATHS, streams):
        assert events[-1] == "[DONE]" and all("error" not in e for e in events[:-1]), name
        assert "".join(e["choices"][0]["text"] for e in events[:-1] if e["choices"]) == solo[name], name


def test_overload_503_and_disconnect_frees_everything(server):
    """Fill the bounded queue with long streams (co-located and separate: slow enough to still run
    when the extra request arrives), check 503 for one more, then drop every client mid-stream:
    sessions and KV slots must all come back."""
    paths = ["colocated" if i % 2 else "separate" for i in range(MAX_INFLIGHT)]
    before = stats(server)

    async def scenario():
        async with httpx.AsyncClient(base_url=server["url"], timeout=120) as ac:
            streams, responses = [], []
            for path in paths:
                req = ac.build_request("POST", "/v1/completions", json={
                    "model": "tiny", "prompt": "It is a truth", "max_tokens": 400, "temperature": 0,
                    "ignore_eos": True, "stream": True, "speculation": PATHS[path]})
                responses.append(ac.send(req, stream=True))
            responses = await asyncio.gather(*responses)
            for r in responses:
                assert r.status_code == 200
                lines = r.aiter_lines()
                while not (await lines.__anext__()).startswith("data: "):
                    pass
                streams.append(lines)
            busy = await asyncio.to_thread(stats, server)
            extra = await ac.post("/v1/completions", json={"model": "tiny", "prompt": "x", "max_tokens": 2})
            for r in responses:  # disconnect mid-stream
                await r.aclose()
            return busy, extra

    busy, extra = asyncio.run(scenario())
    assert busy["router"]["inflight"] == MAX_INFLIGHT
    assert busy["router"]["active"]["separate"] == paths.count("separate")
    assert sum(r["running"] for r in busy["colocated"]) >= 1
    assert sum(r["sessions"] for r in busy["target"]) >= 1
    _assert_error(extra, 503)
    assert extra.json()["error"]["code"] == "overloaded"
    after = wait_idle(server, timeout=60)
    aborted = lambda s: sum(r["aborted"] for r in s["plain"] + s["colocated"])
    assert aborted(after) - aborted(before) == paths.count("colocated")
    assert after["router"]["separate_aborted"] - before["router"]["separate_aborted"] == paths.count("separate")
    assert max(r["max_batch"] for r in after["target"]) >= 2  # verify calls of concurrent sessions fused
    with httpx.Client(base_url=server["url"], timeout=60) as c:
        assert complete(c, max_tokens=3)["usage"]["completion_tokens"] == 3


def test_nonstream_client_gone_frees_everything(server):
    """A non-streamed request whose client gives up mid-generation: Serve cancels the handler, the
    engine aborts (co-located) or the router releases both sides (separate). The client leaves once
    the router reports the request running, not after a fixed time."""
    before = stats(server)

    async def leave_mid_generation(spec, pool):
        async with httpx.AsyncClient(base_url=server["url"], timeout=120) as ac:
            call = asyncio.create_task(ac.post("/v1/completions", json={
                "model": "tiny", "prompt": "It is a truth", "max_tokens": 400, "temperature": 0,
                "ignore_eos": True, "speculation": spec}))
            while not (await asyncio.to_thread(stats, server))["router"]["active"][pool]:
                assert not call.done(), "the request finished before the client could leave"
                await asyncio.sleep(0.05)
            call.cancel()
            with pytest.raises(asyncio.CancelledError):
                await call

    for spec, pool in ((COLOCATED, "colocated"), (SEPARATE, "separate")):
        asyncio.run(leave_mid_generation(spec, pool))
    after = wait_idle(server, timeout=60)
    assert sum(r["aborted"] for r in after["colocated"]) == sum(r["aborted"] for r in before["colocated"]) + 1
    assert after["router"]["separate_aborted"] == before["router"]["separate_aborted"] + 1
