"""A local cluster serving the app, and the client side of its SSE streams: one copy for the tests,
the benchmarks and the launcher. Ray starts with token authentication (SECURITY.md) and the
HTTP edge's proxy callback, as ``./run`` starts it; everything listens on 127.0.0.1 only."""

from __future__ import annotations

import contextlib
import json
import os
import random
import socket
from collections.abc import Iterable, Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# Where free_port looks: below Linux's ephemeral range (32768-60999), from which the OS hands out the
# ports of bind(0) and of outgoing connections (Ray's processes take theirs there), and above Ray's
# worker ports (10002-19999). A port found free here stays free unless someone asks for it by number.
FREE_PORTS = range(20000, 32000)


def serving_environment() -> None:
    """What the serving processes need before Ray is imported (it reads them once per process)."""
    os.environ.setdefault("RAY_AUTH_MODE", "token")
    os.environ.setdefault("RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH", "deployments.proxy_edge:middlewares")
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))


def free_port() -> int:
    """A 127.0.0.1 port free now, from ``FREE_PORTS``: one of the OS's choosing could be handed to one of
    Ray's processes before whoever it was picked for binds it (CI: "Failed to bind to address")."""
    for port in random.sample(FREE_PORTS, 100):
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free port in {FREE_PORTS}")


@contextlib.contextmanager
def running_app(args: dict, name: str, metrics_port: int | None = None, num_cpus: int = 2) -> Iterator[dict]:
    """A local Ray cluster serving ``build_app(args)`` as app ``name`` on a free 127.0.0.1 port,
    shut down on exit: {"url", "router"}."""
    serving_environment()
    import ray
    from ray import serve

    from deployments.app import build_app

    extra = {} if metrics_port is None else {"_metrics_export_port": metrics_port}
    ray.init(address="local", num_cpus=num_cpus, include_dashboard=False, log_to_driver=False, **extra)
    try:
        port = start_serve_on_a_free_port()
        serve.run(build_app(args), name=name, route_prefix="/")
        yield {"url": f"http://127.0.0.1:{port}", "router": serve.get_deployment_handle("Router", name)}
    finally:
        serve.shutdown()
        ray.shutdown()


def start_serve_on_a_free_port(tries: int = 3, **start_options) -> int:
    """Start Serve's proxy on a free port, and pick again if it was taken before the proxy bound it (a
    process that asked for that port by number in between)."""
    import ray
    from ray import serve

    for _ in range(tries - 1):
        port = free_port()
        try:
            serve.start(http_options={"host": "127.0.0.1", "port": port}, **start_options)
            return port
        except ray.exceptions.RayTaskError as e:
            if "Failed to bind" not in str(e):
                raise
            serve.shutdown()
    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port}, **start_options)
    return port


def sse_event(line: str) -> dict | str | None:
    """One SSE line of an OpenAI stream: its JSON chunk, "[DONE]", or None (not a data line)."""
    if not line.startswith("data: "):
        return None
    payload = line[len("data: "):]
    return payload if payload == "[DONE]" else json.loads(payload)


def sse_events(lines: Iterable[str]) -> list:
    return [e for e in map(sse_event, lines) if e is not None]
