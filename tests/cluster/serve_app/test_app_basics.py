"""The served app's basics: health, models, the HTTP server's own answers, request ids, completions and
chat over httpx and the official openai client."""

from __future__ import annotations

import json
import time

import pytest
from served import COLOCATED, HEADER_TIMEOUT_S, complete, raw_answer

pytestmark = pytest.mark.timeout(300)


def test_health_models(client):
    assert client.get("/health").json() == {"status": "ok"}
    models = client.get("/v1/models").json()
    assert models["object"] == "list" and [m["id"] for m in models["data"]] == ["tiny"]


def test_the_proxys_http_server_answers_openai_errors_and_times_out_slow_headers(server, client):
    """Serve's proxy runs deployments/proxy_edge.py's guards (tests/unit/test_http_edge.py has the cases):
    what does not parse as HTTP gets OpenAI's body, half-sent headers a 408 after the header timeout."""
    bad = raw_answer(server["url"], b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: -1\r\n\r\n")
    assert bad.startswith(b"HTTP/1.1 400") and json.loads(bad.partition(b"\r\n\r\n")[2])["error"]["code"] == \
        "invalid_http", bad
    t0 = time.monotonic()
    slow = raw_answer(server["url"], b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")
    # the server's timer runs on its own loop's clock: it may fire a hair before this clock's 2 s (1.9999997 s seen)
    assert slow.startswith(b"HTTP/1.1 408") and 0.95 * HEADER_TIMEOUT_S <= time.monotonic() - t0 < 10 * HEADER_TIMEOUT_S
    assert complete(client, max_tokens=2)["usage"]["completion_tokens"] == 2  # and the server serves on


def test_one_request_id_per_answer_and_it_is_the_servers(client):
    """Every answer carries exactly one x-request-id, made by the server: a client's own id does not
    become the request's (it could reuse one, or another client's), and no path redirects."""
    for headers in ({}, {"x-request-id": "client-chosen"}):
        for method, path in (("GET", "/health"), ("GET", "/v1/models"), ("GET", "/v1/models/"),
                             ("POST", "/v1/completions")):
            r = client.request(method, path, headers=headers, json={"model": "tiny", "prompt": "hi", "max_tokens": 2})
            ids = r.headers.get_list("x-request-id")
            assert len(ids) == 1 and ids[0] != "client-chosen", (path, r.status_code, r.headers)
            assert not 300 <= r.status_code < 400, (path, r.status_code)


def test_completion_and_chat_httpx(client):
    out = complete(client, max_tokens=8)
    choice = out["choices"][0]
    assert out["object"] == "text_completion" and isinstance(choice["text"], str)
    assert out["usage"]["completion_tokens"] == 8 == len(choice["token_ids"])
    spec = out["speculation"]
    assert set(spec) >= {"mode", "topology", "num_speculative_tokens", "proposed_tokens", "accepted_tokens",
                         "acceptance_rate", "mean_acceptance_length"}
    # token-id prompt: same tokens as the string prompt gives the same output
    ids_out = complete(client, prompt=[5, 17, 42], max_tokens=4)
    assert ids_out["usage"]["prompt_tokens"] == 3
    r = client.post("/v1/chat/completions", json={
        "model": "tiny", "messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}],
        "max_tokens": 6, "temperature": 0, "ignore_eos": True})
    assert r.status_code == 200, r.text
    chat = r.json()
    assert chat["object"] == "chat.completion"
    assert chat["choices"][0]["message"]["role"] == "assistant"
    assert chat["usage"]["completion_tokens"] == 6 and "speculation" in chat


def test_openai_client(server):
    import openai

    oc = openai.OpenAI(base_url=server["url"] + "/v1", api_key="unused", max_retries=0)
    assert [m.id for m in oc.models.list().data] == ["tiny"]
    c = oc.completions.create(model="tiny", prompt="In the beginning", max_tokens=6, temperature=0,
                              extra_body={"ignore_eos": True, "speculation": COLOCATED})
    assert c.usage.completion_tokens == 6 and c.choices[0].finish_reason == "length"
    assert c.model_extra["speculation"]["topology"] == "colocated"
    chat = oc.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Hello"}], max_tokens=5,
                                      temperature=0, extra_body={"ignore_eos": True})
    assert chat.choices[0].message.role == "assistant" and chat.usage.completion_tokens == 5
    chunks = list(oc.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "Hello"}], max_tokens=5, temperature=0, stream=True,
        stream_options={"include_usage": True}, extra_body={"ignore_eos": True}))
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert text == chat.choices[0].message.content
    assert chunks[-1].usage.completion_tokens == 5 and chunks[-1].model_extra["speculation"] is not None
    with pytest.raises(openai.NotFoundError):
        oc.completions.create(model="nope", prompt="x", max_tokens=2)
