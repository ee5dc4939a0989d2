"""Past one machine (issue 38): the app on a 3-node Ray cluster on this machine
(``ray.cluster_utils.Cluster``: a raylet, an object store and workers per node), the Draft and the
Target placed on different nodes by custom resources from the config, the separate topology's
channels crossing nodes. Removing the Target's node mid-stream (its raylet and every replica on it
gone at once) costs the requests nothing: each finishes whole, identical to the plain output, with
no error event, and new requests are served."""

from __future__ import annotations

import concurrent.futures
import json
import socket
import time

import httpx
import pytest
from served import APP, PLAIN, SEPARATE, app_args, sse_events, synthetic_costs

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

PROMPTS = [[7, 3, 11, 5], [2, 9, 4], [5, 5, 1, 8, 3]]
MAX_TOKENS = 400  # long enough that the node goes while every stream runs


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def cluster_app(tiny_models, tmp_path_factory):
    import ray
    from ray import serve
    from ray.cluster_utils import Cluster

    from deployments.app import build_app
    from deployments.calibrate import record, save_calibration

    calibration = str(tmp_path_factory.mktemp("calibration") / "calibration.json")
    save_calibration(calibration, record(synthetic_costs(), tiny_models["target"], tiny_models["draft"], "cpu"))
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 2, "resources": {"head_node": 1}})
    target_node = cluster.add_node(num_cpus=1, resources={"target_node": 1})
    draft_node = cluster.add_node(num_cpus=1, resources={"draft_node": 1})
    cluster.wait_for_nodes()
    ray.init(address=cluster.address, log_to_driver=False)
    on = lambda resource: {"num_cpus": 0.1, "resources": {resource: 0.01}}  # noqa: E731
    args = {**app_args(tiny_models, calibration), "router": on("head_node"), "plain": on("head_node"),
            "colocated": on("head_node"), "draft_deployment": on("draft_node"),
            "target_deployment": on("target_node"), "step_timeout_s": 15.0}
    port = _free_port()
    try:
        # The proxy on the head only: every node's proxy would bind this port on this one machine, and a
        # stream through the proxy of the node that goes would go with it (README, "Placement across nodes").
        serve.start(proxy_location="HeadOnly", http_options={"host": "127.0.0.1", "port": port})
        serve.run(build_app(args), name=APP, route_prefix="/")
        yield {"url": f"http://127.0.0.1:{port}", "cluster": cluster, "target_node": target_node,
               "draft_node": draft_node}
    finally:
        serve.shutdown()
        ray.shutdown()
        cluster.shutdown()


def replica_nodes(deployment: str) -> set[str]:
    from ray.util.state import list_actors

    return {a.node_id for a in list_actors(filters=[("class_name", "=", f"ServeReplica:{APP}:{deployment}"),
                                                    ("state", "=", "ALIVE")])}


def body(prompt, speculation) -> dict:
    return {"model": "tiny", "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True,
            "return_token_ids": True, "speculation": speculation}


def stream(url: str, prompt, started: concurrent.futures.Future) -> list:
    events, tokens = [], 0
    with httpx.Client(base_url=url, timeout=300) as client, \
            client.stream("POST", "/v1/completions", json={**body(prompt, SEPARATE), "stream": True}) as r:
        for line in r.iter_lines():
            for event in sse_events([line]):
                events.append(event)
                if event != "[DONE]" and event.get("choices"):
                    tokens += len(event["choices"][0].get("token_ids") or [])
                    if tokens >= 16 and not started.done():
                        started.set_result(True)
    return events


def test_target_node_lost_mid_stream_loses_nothing(cluster_app):
    url = cluster_app["url"]
    draft_nodes, target_nodes = replica_nodes("Draft"), replica_nodes("Target")
    assert target_nodes == {cluster_app["target_node"].node_id}
    assert draft_nodes == {cluster_app["draft_node"].node_id} and draft_nodes != target_nodes
    with httpx.Client(base_url=url, timeout=300) as client:
        refs = [client.post("/v1/completions", json=body(p, PLAIN)).json()["choices"][0]["token_ids"]
                for p in PROMPTS]
        warm = client.post("/v1/completions", json=body(PROMPTS[0], SEPARATE)).json()
    assert warm["choices"][0]["token_ids"] == refs[0] and warm["speculation"]["proposed_tokens"] > 0
    with concurrent.futures.ThreadPoolExecutor(len(PROMPTS)) as pool:
        started = [concurrent.futures.Future() for _ in PROMPTS]
        streams = [pool.submit(stream, url, p, s) for p, s in zip(PROMPTS, started)]
        concurrent.futures.wait(started, timeout=120, return_when=concurrent.futures.FIRST_COMPLETED)
        t_removed = time.monotonic()
        cluster_app["cluster"].remove_node(cluster_app["target_node"])  # raylet, object store, replicas: gone
        results = [s.result(timeout=300) for s in streams]
    for events, ref in zip(results, refs):
        assert events[-1] == "[DONE]" and not any("error" in e for e in events[:-1]), json.dumps(events[-3:])
        chunks = [e for e in events[:-1] if e["choices"]]
        assert [t for c in chunks for t in c["choices"][0]["token_ids"]] == ref
    migrated = [[e for e in events[:-1] if e["choices"]][-1]["speculation"]["migrations"] for events in results]
    assert migrated.count(1) >= 1 and set(migrated) <= {0, 1}, migrated  # each moved once, if it was still running
    assert time.monotonic() - t_removed < 120
    with httpx.Client(base_url=url, timeout=300) as client:  # no node offers target_node now: plain elsewhere
        r = client.post("/v1/completions", json={**body(PROMPTS[1], SEPARATE), "max_tokens": 8})
    assert r.status_code == 200 and r.json()["choices"][0]["token_ids"] == refs[1][:8], r.text
