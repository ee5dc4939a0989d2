"""Past one machine (issue 38): the app on a 3-node Ray cluster on this machine
(``ray.cluster_utils.Cluster``: a raylet, an object store and workers per node), the Draft and the
Target placed on different nodes by custom resources from the config, the separate topology's
channels crossing nodes. Removing the Target's node mid-stream (its raylet and every replica on it
gone at once) costs the requests nothing: each finishes whole, identical to the plain output, with
no error event, and new requests are served; once the node is back, Serve places the Target there
again and the separate topology speculates. The placement is ``specdec_bench/nodes.py``'s (two
plain replicas on two nodes, two routers on the head), the one the benchmarks run."""

from __future__ import annotations

import concurrent.futures
import json
import time

import httpx
import pytest
from served import APP, PLAIN, SEPARATE, app_args, sse_events, synthetic_costs

from specdec_bench.nodes import placement, replica_nodes, running_cluster_app

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

PROMPTS = [[7, 3, 11, 5], [2, 9, 4], [5, 5, 1, 8, 3]]
MAX_TOKENS = 400  # long enough that the node goes while every stream runs


@pytest.fixture(scope="module")
def cluster_app(tiny_models, tmp_path_factory):
    from deployments.calibrate import record, save_calibration

    calibration = str(tmp_path_factory.mktemp("calibration") / "calibration.json")
    save_calibration(calibration, record(synthetic_costs(), tiny_models["target"], tiny_models["draft"], "cpu"))
    args = placement({**app_args(tiny_models, calibration), "step_timeout_s": 15.0})
    with running_cluster_app(args, APP) as app:
        yield app


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
    url, nodes = cluster_app["url"], cluster_app["nodes"]
    a, b = nodes.workers["a"].node_id, nodes.workers["b"].node_id
    assert replica_nodes(APP, "Target") == [a] and replica_nodes(APP, "Draft") == [b]
    assert sorted(replica_nodes(APP, "PlainPool")) == sorted([a, b])  # a plain_slot each: one per node
    assert len(replica_nodes(APP, "Router")) == 2
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
        nodes.remove("a")  # raylet, object store, the Target and a plain replica: gone
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
        nodes.add("a")  # the node comes back: Serve reschedules the Target there, speculation resumes
        deadline = time.monotonic() + 180
        while replica_nodes(APP, "Target") != [nodes.workers["a"].node_id] and time.monotonic() < deadline:
            time.sleep(1.0)
        spec = {"proposed_tokens": 0}
        while not spec["proposed_tokens"] and time.monotonic() < deadline:  # the router finds the new Target
            out = client.post("/v1/completions", json={**body(PROMPTS[2], SEPARATE), "max_tokens": 32}).json()
            assert out["choices"][0]["token_ids"] == refs[2][:32]
            spec = out["speculation"]
            time.sleep(0.5)
    assert spec["proposed_tokens"] > 0 and spec["pool"] == "separate", spec
