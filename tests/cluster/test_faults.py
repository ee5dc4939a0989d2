"""Replica faults on a served app (tiny models, one replica per deployment): a model replica killed
mid-stream (ray.kill, as a crash), or an engine replica's engine process killed (the replica then
exits), costs its requests nothing. Engine pools and the Target migrate
the request (prompt + the tokens emitted so far prefilled elsewhere); a dead Draft turns the
request's remaining steps plain. The client's stream is the fault-free output, whole, with no
error event."""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import httpx
import pytest
from served import APP, MAX_LEN, PATHS, app_args, running_app, sse_events, synthetic_costs

pytestmark = pytest.mark.timeout(600)

PROMPT = [7, 3, 11, 5]
STEP_TIMEOUT_S = 15.0


@pytest.fixture(scope="module")
def server(tiny_models, tmp_path_factory):
    from deployments.calibrate import record, save_calibration

    calibration = str(tmp_path_factory.mktemp("calibration") / "calibration.json")
    save_calibration(calibration, record(synthetic_costs(), tiny_models["target"], tiny_models["draft"], "cpu"))
    # A long step timeout: a dead replica must be noticed by its closed channel, not by a step timing out.
    args = {**app_args(tiny_models, calibration), "target_deployment": {"num_cpus": 0.1, "num_replicas": 1},
            "step_timeout_s": STEP_TIMEOUT_S}
    with running_app(args) as app:
        yield app


def router_stats(server) -> dict:
    return server["router"].pool_stats.remote().result(timeout_s=60)["router"]


def kill_replicas(deployment: str) -> int:
    import ray

    names = [a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
             if a["name"].startswith(f"SERVE_REPLICA::{APP}#{deployment}#")]
    for name in names:
        ray.kill(ray.get_actor(name, namespace="serve"), no_restart=True)
    return len(names)


def _cmdline(pid: str) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""


def kill_engine_processes(deployment: str) -> int:
    """SIGKILL the engine process (deployments/engine_process.py) of each of the deployment's replicas."""
    killed = 0
    for pid in filter(str.isdigit, os.listdir("/proc")):
        if "deployments.engine_process" not in _cmdline(pid):
            continue
        status = Path(f"/proc/{pid}/status").read_text()
        parent = next(line.split()[1] for line in status.splitlines() if line.startswith("PPid:"))
        if f"ServeReplica:{APP}:{deployment}" in _cmdline(parent):  # the replica's process title
            os.kill(int(pid), signal.SIGKILL)
            killed += 1
    return killed


def wait_running(timeout: float = 120.0) -> None:
    from ray import serve

    deadline = time.time() + timeout
    while serve.status().applications[APP].status != "RUNNING":
        assert time.time() < deadline, "the app did not recover"
        time.sleep(0.5)


@pytest.mark.parametrize("deployment, path, kill", [
    ("PlainPool", "plain", kill_replicas), ("ColocatedPool", "colocated", kill_replicas),
    ("Target", "separate", kill_replicas), ("Draft", "separate", kill_replicas),
    ("PlainPool", "plain", kill_engine_processes),  # the replica's engine process alone: the replica follows it
], ids=["PlainPool", "ColocatedPool", "Target", "Draft", "PlainPool-engine-process"])
def test_a_replica_killed_mid_stream_loses_nothing(server, deployment, path, kill):
    wait_running()
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": MAX_LEN - len(PROMPT), "temperature": 0,
            "ignore_eos": True, "return_token_ids": True, "speculation": PATHS[path]}
    with httpx.Client(base_url=server["url"], timeout=300) as client:
        ref = client.post("/v1/completions", json=body).json()["choices"][0]
        before = router_stats(server)
        events, ids, killed, arrivals = [], [], 0, []
        with client.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
            for line in r.iter_lines():
                for event in sse_events([line]):
                    events.append(event)
                    arrivals.append(time.monotonic())
                    if event != "[DONE]" and event.get("choices"):
                        ids += event["choices"][0].get("token_ids") or []
                if not killed and len(ids) >= 20:
                    killed = kill(deployment)
                    killed_at = time.monotonic()
    assert killed == 1
    if path == "separate":  # the dead replica's closed channel said so: no step waited for a timeout
        gaps = [b - a for a, b in zip([killed_at] + arrivals, arrivals) if b >= killed_at]
        assert max(gaps) < STEP_TIMEOUT_S / 2, max(gaps)
    assert events[-1] == "[DONE]" and not any("error" in e for e in events[:-1]), json.dumps(events[-3:])
    chunks = [e for e in events[:-1] if e["choices"]]
    assert [t for c in chunks for t in c["choices"][0]["token_ids"]] == ref["token_ids"]
    assert "".join(c["choices"][0]["text"] for c in chunks) == ref["text"]
    after = router_stats(server)
    if deployment == "Draft":  # no migration: the rest of the request ran plain verify steps
        assert after["draft_failures"] == before["draft_failures"] + 1
        wait_running()  # speculation resumes once the restarted Draft answers (after DRAFT_RETRY_S)
        assert_speculates_again(server, body)
        return
    assert after["migrations"] == before["migrations"] + 1
    assert chunks[-1]["speculation"]["migrations"] == 1
    # The pool lost its only replica: priced unavailable until it answers a health probe again, so
    # nothing waits for its restart. Plain decoding runs in the co-located pool meanwhile (K=0);
    # speculation asked for in that pool itself decodes plain in a pool that is up, and says so. A
    # tiny model's replica can be back within a second or two, even between the check and the
    # request: then the pool serves it itself.
    assert after["pools_lost"].get(path, 0) == before["pools_lost"].get(path, 0) + 1, after
    if path in router_stats(server)["down"]:
        with httpx.Client(base_url=server["url"], timeout=300) as client:
            r = client.post("/v1/completions", json={**body, "max_tokens": 8})
        assert r.status_code == 200, r.text
        spec = r.json()["speculation"]
        if path == "plain":
            assert (spec["pool"], spec["num_speculative_tokens"]) in (("colocated", 0), ("plain", 0)), spec
        elif spec["pool"] != path:  # not back up meanwhile
            assert spec["num_speculative_tokens"] == 0 and "down" in spec["route_reason"], spec
    wait_running()
    deadline = time.time() + 60
    while router_stats(server)["down"]:
        assert time.time() < deadline, "the restarted pool was never probed back up"
        time.sleep(0.5)
    if path == "separate":  # the new Target replica's channel is found and used
        assert_speculates_again(server, body)


def assert_speculates_again(server, body: dict) -> None:
    """A separate request, a few seconds after a replica restart, speculates on the separate pool
    again with the fault-free output."""
    with httpx.Client(base_url=server["url"], timeout=300) as client:
        ref = client.post("/v1/completions", json={**body, "max_tokens": 24}).json()["choices"][0]["token_ids"]
        deadline = time.time() + 60
        while True:
            out = client.post("/v1/completions", json={**body, "max_tokens": 24}).json()
            spec = out["speculation"]
            if spec["pool"] == "separate" and spec["proposed_tokens"] > 0:
                break
            assert time.time() < deadline, spec
            time.sleep(1.0)
    assert out["choices"][0]["token_ids"] == ref
