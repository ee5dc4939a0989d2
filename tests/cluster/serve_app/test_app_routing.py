"""Regime-aware routing (mode auto) as served: speculation where it pays, plain inside a replica when
acceptance collapses, a burst that goes plain in the large-batch regime, /v1/regimes and the
Prometheus metrics."""

from __future__ import annotations

import asyncio
import os
import time

import httpx
import pytest
from served import COLOCATED, MAX_INFLIGHT, PLAIN, complete, sse_event, wait_idle

pytestmark = pytest.mark.timeout(300)


def test_the_first_auto_request_routes_on_the_calibrated_costs(server):
    """Sent right after the app first answered: the router's fetch of the replicas' step costs may still
    be out, and the request waits for it rather than routing on the prior table (which sent it to the
    separate topology)."""
    spec = server["first_response"]["speculation"]
    assert spec["costs_source"].startswith("file:"), spec
    assert spec["pool"] == "colocated", spec


def test_auto_speculates_single_greedy_request(client):
    t0 = time.perf_counter()
    out = complete(client, max_tokens=32, user="regime-single")  # no speculation field: mode auto
    elapsed = time.perf_counter() - t0
    spec = out["speculation"]
    assert (spec["pool"], spec["topology"], spec["mode"], spec["regime"]) == (
        "colocated", "colocated", "speculative", "favorable"), spec
    assert spec["adaptive_k"] and 1 <= spec["num_speculative_tokens"] <= 8
    assert spec["predicted_speedup"] > 1.05 and spec["batch"] == 1 and spec["mean_batch"] == 1.0  # alone throughout
    assert spec["costs_source"].startswith("file:")  # the replica's calibration reached the router
    assert spec["realised_speedup"] is not None and spec["realised_speedup"] > 0
    assert out["usage"]["completion_tokens"] == 32
    # its decode steps: fewer than its tokens (it speculated), each a positive wall time
    assert 0 < spec["decode_steps"] < 32 and spec["decode_s"] > 0, spec
    assert spec["prefill_wait_s"] == 0.0, spec  # alone: no other request's prefill ran while it decoded
    # its engine's arrival to first token: within the request's time by the client's clock, before its decode
    assert 0 < spec["engine_first_token_s"] < elapsed - spec["decode_s"], spec
    # the same request, greedy: adaptive K changes nothing in the output
    ref = complete(client, max_tokens=32, speculation=PLAIN)
    assert out["choices"][0]["token_ids"] == ref["choices"][0]["token_ids"]
    assert ref["speculation"]["regime"] in ROUTING_REGIMES and ref["speculation"]["pool"] == "plain"
    # served steps teach the router's drift correction (GET /v1/regimes), which auto requests carry to
    # the replicas: the plain request's batch-1 steps counted, or set aside as outliers against the
    # test's calibration file, which another run measured. (The auto request above teaches none: its
    # adaptive K changed, so its steps have no single shape.)
    drift = client.get("/v1/regimes").json()["costs"]["drift"]
    assert "0" in drift, drift
    assert drift["0"]["plain_steps"] + drift["0"]["spec_steps"] > 0 or drift["0"]["outlier_rate"] > 0, drift
    # throughput objective: plain, by the request field or a bulk service tier
    for extra in ({"speculation": {"objective": "throughput"}}, {"service_tier": "flex"}):
        bulk = complete(client, max_tokens=4, user="regime-single", **extra)["speculation"]
        assert (bulk["pool"], bulk["num_speculative_tokens"]) == ("plain", 0), bulk
        assert "throughput" in bulk["route_reason"]


def test_auto_adaptive_k_drops_to_plain_inside_replica(client):
    """Auto speculation runs with adaptive K in the co-located replica: the random tiny draft's
    acceptance collapses, so the request soon decodes with K=0 there; an explicit K stays fixed."""
    auto = complete(client, max_tokens=96, user="adaptive-drop")["speculation"]
    assert auto["pool"] == "colocated" and auto["adaptive_k"], auto
    fixed = complete(client, max_tokens=96, user="adaptive-fixed", speculation=COLOCATED)["speculation"]
    assert not fixed["adaptive_k"] and fixed["num_speculative_tokens"] == 4
    assert auto["acceptance_rate"] < 0.5  # the premise: this draft disagrees with the target
    assert auto["plain_steps"] > fixed["plain_steps"] + 20, (auto, fixed)
    # and says what set its K to 0 (its price or its regret guard), step for step; a fixed K has none
    assert sum(auto["plain_steps_by_cause"].values()) == auto["plain_steps"] - 1, auto
    assert not fixed["plain_steps_by_cause"], fixed


def test_a_streamed_auto_request_teaches_what_its_pool_declined_while_it_decodes(server, client):
    """The tiny draft disagrees with the target, so the co-located replica's adaptive K runs an auto request
    mostly plain (above). Its stream's deltas count its decode steps so far, and the router learns the
    decline window by window: /v1/regimes lists the lesson for its class while the request still decodes."""
    body = {"model": "tiny", "prompt": "It is a truth universally", "max_tokens": 240, "temperature": 0,
            "ignore_eos": True, "return_token_ids": True, "stream": True, "user": "live-decline"}
    received, lessons, spec = 0, None, {}
    with client.stream("POST", "/v1/completions", json=body) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            event = sse_event(line)
            if not isinstance(event, dict) or not event["choices"]:
                continue
            choice, spec = event["choices"][0], event.get("speculation") or spec
            received += len(choice["token_ids"])
            if received >= 160 and choice["finish_reason"] is None and lessons is None:
                declined = httpx.get(f"{server['url']}/v1/regimes", timeout=30).json()["declined"]
                lessons = [d for d in declined if d["class"]["domain"] == "live-decline"]
    assert received == 240 and (spec["pool"], spec["adaptive_k"]) == ("colocated", True), spec
    assert lessons, "no lesson before the request's last delta"
    (lesson,) = lessons
    assert lesson["pool"] == "colocated" and lesson["learnt_s_ago"] < 30, lesson


def test_auto_burst_goes_plain_in_large_batch_regime(server):
    """Concurrent auto requests, each its own traffic class (fresh `user`: acceptance = the prior). The
    app's five engine processes share this machine's cores where it has fewer (``pools_share_compute``
    null), so each request is priced at the whole burst's batch: the first ones speculate
    (favorable), later ones stay with the load in the speculative pool while speculation there is
    within ``route_split_margin`` of plain (under the synthetic costs K=1 stays within 2% of plain up
    to batch 30), and past break-even (co-located at a = 0.9: batch 7) they are labelled large_batch
    whether they stay or run plain. On cores of their own the rest go to the plain pool."""
    wait_idle(server)
    n = MAX_INFLIGHT - 2

    async def burst():
        async with httpx.AsyncClient(base_url=server["url"], timeout=120) as ac:
            async def one(i):
                r = await ac.post("/v1/completions", json={
                    "model": "tiny", "prompt": f"Burst {i}: it is a truth", "max_tokens": 64, "temperature": 0,
                    "ignore_eos": True, "user": f"burst-{i}"})
                assert r.status_code == 200, r.text
                return r.json()["speculation"]
            return await asyncio.gather(*(one(i) for i in range(n)))

    specs = asyncio.run(burst())
    seen = [(s["pool"], s["batch"], s["probe"], s["regime"], s["route_reason"]) for s in specs]
    spec_pool = [s for s in specs if s["pool"] in ("colocated", "separate") and not s["probe"]]
    plain = [s for s in specs if s["pool"] == "plain" and not s["probe"]]
    assert spec_pool and all(s["regime"] == "favorable" and s["predicted_speedup"] > 1.05
                             or s["route_reason"].startswith("stays with the load") for s in spec_pool), seen
    assert any(s["regime"] == "favorable" for s in spec_pool), seen
    large = [s for s in specs if s["regime"] == "large_batch" and not s["probe"]]
    assert large and all(s["pool"] == "plain" and s["num_speculative_tokens"] == 0
                         or s["route_reason"].startswith("stays with the load") for s in large), seen
    if not server_shares_cores():
        assert plain, seen  # on cores of their own, past break-even the rest go plain
    wait_idle(server)


def test_a_streamed_request_counts_in_its_pools_load_from_its_plan(server, client):
    """The batch a request is planned at (``speculation.batch``) counts the requests its pool runs. A
    streamed burst: each request sees every one planned before it, also those whose response had not
    started sending when it was planned (counted from their first iteration, six requests planned as
    [1, 2, 2, 2, 5, 6])."""
    wait_idle(server)
    replicas = client.get("/v1/regimes").json()["pools"]["plain"]["replicas"]
    n = 6

    async def streamed(ac, i):
        body = {"model": "tiny", "prompt": f"Stream {i}: it is a truth", "max_tokens": 200,
                "temperature": 0, "ignore_eos": True, "stream": True, "speculation": PLAIN}
        async with ac.stream("POST", "/v1/completions", json=body) as r:
            assert r.status_code == 200
            events = [e async for e in _events(r.aiter_lines())]
        assert events[-1] == "[DONE]"
        return next(e["speculation"] for e in events[:-1] if e.get("speculation"))

    async def burst():
        async with httpx.AsyncClient(base_url=server["url"], timeout=120) as ac:
            return await asyncio.gather(*(streamed(ac, i) for i in range(n)))

    planned = sorted(s["batch"] for s in asyncio.run(burst()))
    assert planned == [-(-i // replicas) for i in range(1, n + 1)], planned
    wait_idle(server)


async def _events(lines):
    async for line in lines:
        if (e := sse_event(line)) is not None:
            yield e


def server_shares_cores() -> bool:
    """The app's five single-threaded engine processes outnumber this machine's CPUs."""
    return 5 > (os.cpu_count() or 1)


ROUTING_REGIMES = ("favorable", "high_entropy", "expensive_draft", "domain_mismatch", "large_batch",
                   "orchestration_overhead", "long_context", "prefill_heavy", "no_gain", "unknown")


def test_regimes_endpoint(client):
    # a fixed K, so that every step judges draft tokens: an auto request may decode plain throughout where
    # its adaptive K says so (the separate loop's, after the burst tests, did in 2 of 9 package runs)
    complete(client, user="regime-map", speculation=COLOCATED)
    m = client.get("/v1/regimes").json()
    assert set(m) >= {"draft", "costs", "k_max", "pools", "classes"}
    assert m["costs"]["calibrated"] and m["costs"]["hop_overhead_s"]["separate"] == pytest.approx(0.002)
    assert isinstance(m["costs"]["drift"], dict)
    assert set(m["pools"]) == {"plain", "colocated", "separate"}
    assert set(m["pools"]["plain"]) == {"active", "queued", "replicas", "capacity", "joining",
                                        "joining_shares", "beside", "probing"}
    assert isinstance(m["declined"], list)  # what the pools' adaptive K ran plain, by pool, batch and class
    assert m["shared_compute"] == server_shares_cores()
    assert all(isinstance(p["joining"], float) for p in m["pools"].values())  # rows seen joining while decoding
    # (rows, share) of the requests that saw as many join them: shares of 1, their mean is ``joining``
    for p in m["pools"].values():
        assert sum(share for _, share in p["joining_shares"]) == pytest.approx(1.0)
        assert sum(rows * share for rows, share in p["joining_shares"]) == pytest.approx(p["joining"])
    classes = {(c["temperature_bucket"], c["domain"]): c for c in m["classes"]}
    assert ("greedy", "default") in classes and ("greedy", "regime-map") in classes
    c = classes[("greedy", "regime-map")]
    assert c["evidence"] > 0 and 0 <= c["acceptance"] <= 1 and c["per_position"]
    assert c["cost_ratio_batch1"] == pytest.approx(0.003 / 0.014)
    assert c["break_even_batch"] is None or c["break_even_batch"] >= 1
    assert set(c["choice"]) == {"pool", "topology", "k", "regime", "predicted_speedup", "reason"}
    assert c["choice"]["regime"] in ROUTING_REGIMES


def test_metrics_on_prometheus_endpoint(server, client):
    complete(client, user="regime-metrics")
    want = ("ray_specdec_route_decisions_total", "ray_specdec_acceptance_rate", "ray_specdec_chosen_k",
            "ray_specdec_predicted_speedup", "ray_specdec_realised_speedup", "ray_specdec_output_tokens_total",
            "ray_specdec_pool_running", "ray_specdec_position_acceptance_rate",
            "ray_specdec_time_to_first_token_s_bucket", "ray_specdec_time_per_output_token_s_bucket")
    deadline, text = time.time() + 30, ""
    while time.time() < deadline:
        try:
            text = httpx.get(server["metrics_url"], timeout=5).text
        except httpx.HTTPError:
            text = ""
        if all(w in text for w in want):
            break
        time.sleep(1)
    missing = [w for w in want if w not in text]
    assert not missing, missing


def test_the_serving_bench_sets_each_modes_prediction_beside_its_measured_speedup(server):
    """``specdec-bench serve --interleave`` against the app: every pass carries the router's predicted
    speedup over plain (from each response's ``speculation``) and its measured one against the plain pass."""
    from types import SimpleNamespace

    from specdec_bench.load import run_interleaved

    args = SimpleNamespace(url=server["url"], prompts="prose", temperature=0.0, user=None, mix=None,
                           modes=["plain", "colocated:2"], concurrency=2, requests=2, max_tokens=8)
    passes = {p["mode"]: p for p in asyncio.run(run_interleaved(args, "tiny"))}
    assert passes["plain"]["predicted_speedup"] == 1.0 and passes["plain"]["vs_plain"] == 1.0
    spec = passes["colocated:2"]
    assert spec["routes"] == {"colocated": 2} and spec["errors"] == 0
    # the router's price of K=2 on the app's synthetic costs, which is not plain's 1
    assert 0.0 < spec["predicted_speedup"] < 4.0 and abs(spec["predicted_speedup"] - 1.0) > 1e-6
    assert spec["vs_plain"] == pytest.approx(spec["output_throughput"] / passes["plain"]["output_throughput"])
    # steady tok/s: the concurrency x tokens / latency of the requests that ran at the full load
    assert all(p["steady_output_throughput"] > 0 and p["best_explicit_steady"] in passes for p in passes.values())
