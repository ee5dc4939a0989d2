"""Serve's direct ingress (``RAY_SERVE_ENABLE_DIRECT_INGRESS=1``, README "Lower latency without the
proxy"): the Router replica serves HTTP on a port of its own besides the proxy's. The same requests
through it give the same output as through the proxy, and a client that leaves mid-stream frees every
KV slot, as through the proxy."""

from __future__ import annotations

import httpx
import pytest
from served import PATHS, app_args, complete, free_port, running_app, streamed_token_ids, wait_idle

pytestmark = pytest.mark.timeout(600)

DIRECT_ENV = {"RAY_SERVE_ENABLE_DIRECT_INGRESS": "1"}


def _direct_url(first_port: int) -> str:
    """The Router replica's own HTTP port: the first free one Serve allocates from the configured minimum."""
    for port in range(first_port, first_port + 20):
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                return f"http://127.0.0.1:{port}"
        except httpx.HTTPError:
            continue
    pytest.fail(f"no direct-ingress port answered from {first_port}")


@pytest.fixture(scope="module")
def server(tiny_models):
    first = free_port()
    # Read by the processes the cluster starts (the controller, the proxy, the replicas), so set before it.
    env = {**DIRECT_ENV, "RAY_SERVE_DIRECT_INGRESS_MIN_HTTP_PORT": str(first),
           "RAY_SERVE_DIRECT_INGRESS_MAX_HTTP_PORT": str(first + 20)}
    with pytest.MonkeyPatch.context() as mp:
        for name, value in env.items():
            mp.setenv(name, value)
        with running_app(app_args(tiny_models)) as app:
            yield {**app, "direct": _direct_url(first)}


@pytest.mark.parametrize("path", PATHS)
def test_direct_and_proxy_give_the_same_output(server, path):
    speculation = PATHS[path]
    assert server["direct"] != server["url"]
    with httpx.Client(base_url=server["url"], timeout=120) as proxy, \
            httpx.Client(base_url=server["direct"], timeout=120) as direct:
        via_proxy = complete(proxy, speculation=speculation)["choices"][0]["token_ids"]
        via_direct = complete(direct, speculation=speculation)["choices"][0]["token_ids"]
        streamed = streamed_token_ids(direct, speculation)
    assert via_direct == via_proxy == streamed and len(streamed) == 24


def test_a_client_leaving_mid_stream_frees_everything(server):
    body = {"model": "tiny", "prompt": "It is a truth", "max_tokens": 400, "temperature": 0, "ignore_eos": True,
            "stream": True, "speculation": {"mode": "speculative", "topology": "colocated"}}
    with httpx.Client(base_url=server["direct"], timeout=120) as client:
        with client.stream("POST", "/v1/completions", json=body) as r:
            lines = r.iter_lines()
            assert any(line.startswith("data: ") for line in lines)  # one chunk, then leave
        busy_then_idle = wait_idle(server, timeout=60)
    aborted = sum(r["aborted"] for r in busy_then_idle["plain"] + busy_then_idle["colocated"])
    assert aborted >= 1
    with httpx.Client(base_url=server["direct"], timeout=60) as c:
        assert complete(c, max_tokens=3)["usage"]["completion_tokens"] == 3
