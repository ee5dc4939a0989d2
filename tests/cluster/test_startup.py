"""Start-up: completions are refused (503, code "starting") until every deployment runs, instead of
waiting behind a replica that is not up (an auto request routed to a co-located replica that was still
calibrating waited 58 s). The co-located pool here never starts: its calibration file does not parse."""

from __future__ import annotations

import time

import httpx
import pytest
from served import app_args

from specdec_bench import local_app
from specdec_bench.local_app import serving_environment, start_serve_on_a_free_port

pytestmark = pytest.mark.timeout(240)
APP = "startup"


def _deployment_status(serve, name: str) -> str | None:
    app = serve.status().applications.get(APP)  # None until the thread's deploy reached the controller
    deployment = app.deployments.get(name) if app else None
    return deployment.status if deployment else None


def test_completions_are_refused_until_every_deployment_runs(tiny_models, tmp_path):
    serving_environment()
    import ray
    from ray import serve

    from deployments.app import build_app

    broken = tmp_path / "calibration.json"
    broken.write_text("{not json")
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        port = start_serve_on_a_free_port()
        # serve.run would wait for an app that never runs: deploy without waiting. (A thread left inside
        # serve.run outlived ray.shutdown(), re-initialised Ray on its own and, once that cluster went,
        # Ray's driver ended the whole pytest process with exit 1.)
        serve.run_many([serve.RunTarget(build_app(app_args(tiny_models, str(broken))), name=APP, route_prefix="/")],
                       wait_for_applications_running=False)
        deadline = time.monotonic() + 180
        while not all(_deployment_status(serve, d) == "HEALTHY" for d in ("Router", "PlainPool")):
            assert time.monotonic() < deadline, serve.status()
            time.sleep(0.5)
        assert _deployment_status(serve, "ColocatedPool") != "HEALTHY"
        body = {"model": "tiny", "prompt": "It is a truth", "max_tokens": 4, "speculation": {"mode": "plain"}}
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=60) as client:
            while True:  # the proxy routes to the app once it has seen the Router's replica
                r = client.post("/v1/completions", json=body)
                if r.status_code != 404 or time.monotonic() > deadline:
                    break
                time.sleep(0.5)
            assert r.status_code == 503, r.text  # the plain pool could answer: the service is still starting
            assert r.json()["error"]["code"] == "starting"
            assert client.get("/health").status_code == 503
    finally:
        serve.shutdown()
        ray.shutdown()


def test_a_free_port_is_one_the_os_does_not_hand_out_on_its_own():
    """Ray's processes bind ports of the OS's choosing (its ephemeral range) while a cluster starts: the
    port picked for the proxy or the metrics agent comes from outside that range, and is free."""
    import socket

    low, _high = map(int, open("/proc/sys/net/ipv4/ip_local_port_range").read().split())
    for _ in range(20):
        port = local_app.free_port()
        assert port in local_app.FREE_PORTS and port < low
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))


def test_serve_starts_on_another_port_when_the_one_picked_is_taken_before_the_proxy_binds(monkeypatch):
    """A port found free can be bound by one of Ray's own processes before Serve's proxy binds it (CI saw
    "Failed to bind to address"): the start picks again."""
    serving_environment()
    import socket

    import ray
    from ray import serve

    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    ports = iter([taken.getsockname()[1], local_app.free_port()])
    monkeypatch.setattr(local_app, "free_port", lambda: next(ports))
    ray.init(address="local", num_cpus=1, include_dashboard=False, log_to_driver=False)
    try:
        port = start_serve_on_a_free_port()
        assert port != taken.getsockname()[1]
        r = httpx.get(f"http://127.0.0.1:{port}/-/healthz", timeout=10)
        assert r.text == "Route table is not populated yet."  # Serve's proxy answers there (no app runs)
    finally:
        taken.close()
        serve.shutdown()
        ray.shutdown()
