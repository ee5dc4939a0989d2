"""The Ray Serve app end to end: one local Ray cluster and one Serve app (plain, co-located and
separate paths, two Target replicas) on the tiny models, shared by every test in this module.
HTTP goes to 127.0.0.1 on a free port, with httpx and with the official openai client."""

from __future__ import annotations

import asyncio
import json
import os
import re
import socket
import time

import httpx
import pytest
import torch
from served import (
    APP,
    COLOCATED,
    MAX_INFLIGHT,
    MAX_LEN,
    PATHS,
    PLAIN,
    SEPARATE,
    app_args,
    complete,
    free_port,
    running_app,
    sse_events,
    stats,
    synthetic_costs,
    wait_idle,
)

from specdec_bench import local_app

pytestmark = pytest.mark.timeout(300)

# A request without ignore_eos must end at EOS on every path. The random tiny target never emits
# its EOS token early, so the served copy of it also lists as EOS (generation_config.json, read by
# the engines and the router alike) the token its greedy output for EOS_PROMPT has at EOS_AT.
EOS_PROMPT, EOS_AT = [9, 4, 21], 5


def greedy_ids(model_path: str, prompt: list[int], n: int) -> list[int]:
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_path)
    out = model.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def with_extra_eos(target: str, tmp_path_factory) -> str:
    import shutil

    from transformers import GenerationConfig

    ids = greedy_ids(target, EOS_PROMPT, EOS_AT + 1)
    assert ids[EOS_AT] not in ids[:EOS_AT]
    path = str(tmp_path_factory.mktemp("eos") / "target")
    shutil.copytree(target, path)
    config = GenerationConfig.from_pretrained(path)
    config.eos_token_id = [config.eos_token_id, ids[EOS_AT]]
    config.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def server(tiny_models, tmp_path_factory):
    from deployments.calibrate import record, save_calibration

    models = {**tiny_models, "target": with_extra_eos(tiny_models["target"], tmp_path_factory)}
    calibration = str(tmp_path_factory.mktemp("calibration") / "calibration.json")
    save_calibration(calibration, record(synthetic_costs(), models["target"], models["draft"], "cpu"))
    metrics_port = free_port()
    # the proxy's header timeout (deployments/proxy_edge.py), short enough for a test; read by the proxy
    # processes this cluster starts
    os.environ["SPECDEC_HTTP_HEADER_TIMEOUT_S"] = str(HEADER_TIMEOUT_S)
    try:
        with running_app(app_args(models, calibration), metrics_port=metrics_port) as app:
            yield {**app, "target": models["target"], "metrics_url": f"http://127.0.0.1:{metrics_port}/metrics"}
    finally:
        del os.environ["SPECDEC_HTTP_HEADER_TIMEOUT_S"]


@pytest.fixture(scope="module")
def client(server):
    with httpx.Client(base_url=server["url"], timeout=120) as c:
        yield c


# ---- basics -------------------------------------------------------------------------------------


def test_health_models(client):
    assert client.get("/health").json() == {"status": "ok"}
    models = client.get("/v1/models").json()
    assert models["object"] == "list" and [m["id"] for m in models["data"]] == ["tiny"]


HEADER_TIMEOUT_S = 2.0


def _raw_answer(server, raw: bytes) -> bytes:
    """What the server answers on a fresh connection to ``raw``, until it closes the connection."""
    host, port = server["url"].removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=30) as s:
        s.sendall(raw)
        out = b""
        while chunk := s.recv(65536):
            out += chunk
    return out


def test_the_proxys_http_server_answers_openai_errors_and_times_out_slow_headers(server, client):
    """Serve's proxy runs deployments/proxy_edge.py's guards (tests/unit/test_http_edge.py has the cases):
    what does not parse as HTTP gets OpenAI's body, half-sent headers a 408 after the header timeout."""
    bad = _raw_answer(server, b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: -1\r\n\r\n")
    assert bad.startswith(b"HTTP/1.1 400") and json.loads(bad.partition(b"\r\n\r\n")[2])["error"]["code"] == \
        "invalid_http", bad
    t0 = time.monotonic()
    slow = _raw_answer(server, b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")
    assert slow.startswith(b"HTTP/1.1 408") and HEADER_TIMEOUT_S <= time.monotonic() - t0 < 10 * HEADER_TIMEOUT_S
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


# ---- equivalence across paths, streaming, concurrency ----------------------------------------------


def test_greedy_identical_across_paths(client):
    outs = {name: complete(client, speculation=spec) for name, spec in PATHS.items()}
    ref = outs["plain"]["choices"][0]
    for name, out in outs.items():
        assert out["choices"][0]["token_ids"] == ref["token_ids"], name
        assert out["choices"][0]["text"] == ref["text"], name
        spec = out["speculation"]
        assert spec["topology"] == (None if name == "plain" else name)
        assert spec["num_speculative_tokens"] == (0 if name == "plain" else 4)
        if name != "plain":
            assert spec["proposed_tokens"] > 0 and 1.0 <= spec["mean_acceptance_length"] <= 5.0


def test_a_repeated_prompt_hits_the_prefix_cache_with_the_same_output(server, client):
    """Automatic prefix caching served: the second time a 60-token prompt comes, every engine pool's
    target finds its blocks (GET /v1/stats) and every path answers as the first time."""
    prompt = ("It is a truth universally acknowledged, that a single man in possession of a good fortune, must be "
              "in want of a wife. However little known the feelings or views of such a man may be")

    def hits() -> dict:
        return {pool: sum(r["prefix_cache"]["target"]["hit_tokens"] for r in stats(server)[pool])
                for pool in ("plain", "colocated")}

    first = {name: complete(client, prompt, speculation=spec) for name, spec in PATHS.items()}
    before = hits()
    again = {name: complete(client, prompt, speculation=spec) for name, spec in PATHS.items()}
    after = hits()
    for name in PATHS:
        assert again[name]["choices"][0]["token_ids"] == first[name]["choices"][0]["token_ids"], name
    assert first["plain"]["usage"]["prompt_tokens"] >= 48
    assert all(after[pool] - before[pool] >= 32 for pool in before), (before, after)


def test_stop_string_identical_across_paths(client):
    ref = complete(client, prompt="In the beginning", max_tokens=40, speculation=PLAIN)["choices"][0]["text"]
    starts = [i for i in range(3, len(ref) - 1) if ref[i:i + 2].isascii() and ref[i:i + 2].isalnum()]
    if not starts:
        pytest.skip(f"no ASCII stop candidate in {ref!r}")
    stop = ref[starts[0]:starts[0] + 2]
    outs = {name: complete(client, prompt="In the beginning", max_tokens=40, stop=[stop, "@@never@@"],
                           speculation=spec)["choices"][0] for name, spec in PATHS.items()}
    for name, out in outs.items():
        assert out["finish_reason"] == "stop", name
        assert out["text"] == ref[: ref.find(stop)], name
        body = {"model": "tiny", "prompt": "In the beginning", "max_tokens": 40, "temperature": 0,
                "ignore_eos": True, "stop": [stop], "stream": True, "speculation": PATHS[name]}
        with client.stream("POST", "/v1/completions", json=body) as r:
            chunks = [e for e in sse_events(r.iter_lines()) if e != "[DONE]"]
        assert "".join(c["choices"][0]["text"] for c in chunks) == out["text"], name


@pytest.mark.parametrize("path", list(PATHS))
def test_stream_concatenates_to_nonstream(client, path):
    ref = complete(client, prompt="for i in range(10):", speculation=PATHS[path], max_tokens=20)
    body = {"model": "tiny", "prompt": "for i in range(10):", "max_tokens": 20, "temperature": 0,
            "ignore_eos": True, "return_token_ids": True, "stream": True, "stream_options": {"include_usage": True},
            "speculation": PATHS[path]}
    with client.stream("POST", "/v1/completions", json=body) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        events = sse_events(r.iter_lines())
    assert events[-1] == "[DONE]"
    chunks = [e for e in events[:-1] if e["choices"]]
    assert "".join(c["choices"][0]["text"] for c in chunks) == ref["choices"][0]["text"]
    assert [t for c in chunks for t in c["choices"][0]["token_ids"]] == ref["choices"][0]["token_ids"]
    final = chunks[-1]
    assert final["choices"][0]["finish_reason"] == "length" and final["speculation"]["topology"] == ref[
        "speculation"]["topology"]
    usage_chunk = events[-2]
    assert usage_chunk["choices"] == [] and usage_chunk["usage"]["completion_tokens"] == 20


def test_engine_replicas_send_a_non_streamed_output_as_one_message(server, client):
    """The replica -> router stream is coalesced: a non-streamed request costs one Ray message,
    a streamed one at most one per step (the first token at once)."""
    for spec in (PLAIN, COLOCATED):
        before = stats(server)["router"]["engine_messages"]
        assert complete(client, max_tokens=40, speculation=spec)["usage"]["completion_tokens"] == 40
        assert stats(server)["router"]["engine_messages"] == before + 1


def test_concurrent_greedy_equal_solo(server, client):
    prompts = [f"Request {i}: it is a truth" for i in range(16)]
    paths = [list(PATHS)[i % 3] for i in range(16)]
    solo = [complete(client, prompt=p, speculation=PATHS[path], max_tokens=16)["choices"][0]["token_ids"]
            for p, path in zip(prompts, paths)]
    before = stats(server)

    async def run_all():
        async with httpx.AsyncClient(base_url=server["url"], timeout=120) as ac:
            async def one(p, path):
                r = await ac.post("/v1/completions", json={
                    "model": "tiny", "prompt": p, "max_tokens": 16, "temperature": 0, "ignore_eos": True,
                    "return_token_ids": True, "speculation": PATHS[path]})
                assert r.status_code == 200, r.text
                return r.json()["choices"][0]["token_ids"]
            return await asyncio.gather(*(one(p, path) for p, path in zip(prompts, paths)))

    together = asyncio.run(run_all())
    assert together == solo
    after = wait_idle(server)
    # session affinity on the real path: every separate session opened on exactly one Target replica
    opened = sum(r["sessions_opened"] for r in after["target"]) - sum(r["sessions_opened"] for r in before["target"])
    assert opened == paths.count("separate")


@pytest.mark.parametrize("stream", [False, True])
def test_eos_ends_a_served_request(server, client, stream):
    want = greedy_ids(server["target"], EOS_PROMPT, EOS_AT)
    for name, spec in PATHS.items():
        body = {"model": "tiny", "prompt": EOS_PROMPT, "max_tokens": 20, "temperature": 0,
                "return_token_ids": True, "stream": stream, "speculation": spec}
        if stream:
            with client.stream("POST", "/v1/completions", json=body) as r:
                chunks = [e for e in sse_events(r.iter_lines()) if e != "[DONE]"]
            ids = [t for c in chunks for t in c["choices"][0]["token_ids"]]
            finish = chunks[-1]["choices"][0]["finish_reason"]
        else:
            choice = client.post("/v1/completions", json=body).json()["choices"][0]
            ids, finish = choice["token_ids"], choice["finish_reason"]
        assert (ids, finish) == (want, "stop"), name


def test_requests_run_to_max_model_len(client):
    """max_tokens that fills the context exactly is served whole on every path."""
    prompt = [7, 3, 11, 5]
    for name, spec in PATHS.items():
        out = complete(client, prompt=prompt, max_tokens=MAX_LEN - len(prompt), speculation=spec)
        assert out["usage"]["completion_tokens"] == MAX_LEN - len(prompt), name
        assert out["choices"][0]["finish_reason"] == "length", name


def test_sampled_output_follows_the_target_distribution_on_every_path(server):
    """T=1 with top-k and top-p: the second output token's histogram over 300 seeded requests per
    path matches the target's exact marginal (a path that ignored temperature, top-k or top-p, or
    sampled from the draft, would be off by several times the sampling noise)."""
    from distributions import exact_marginals, expected_tv

    n, prompt, knobs = 300, [7, 3, 11], dict(temperature=1.0, top_k=8, top_p=0.9)
    exact = exact_marginals(server["target"], prompt, 2, **knobs)[1]

    async def sample(spec):
        async with httpx.AsyncClient(base_url=server["url"], timeout=120) as ac:
            limit = asyncio.Semaphore(12)

            async def one(seed):
                async with limit:
                    r = await ac.post("/v1/completions", json={
                        "model": "tiny", "prompt": prompt, "max_tokens": 3, "seed": seed, "ignore_eos": True,
                        "return_token_ids": True, "speculation": spec, **knobs})
                    assert r.status_code == 200, r.text
                    return r.json()
            return await asyncio.gather(*(one(seed) for seed in range(n)))

    for name, spec in PATHS.items():
        outs = asyncio.run(sample(spec))
        if name != "plain":
            assert all(o["speculation"]["proposed_tokens"] == 1 for o in outs), name  # token 2 was verified
        hist = torch.bincount(torch.tensor([o["choices"][0]["token_ids"][1] for o in outs]),
                              minlength=exact.numel()) / n
        tv = 0.5 * (hist - exact).abs().sum().item()
        assert tv < 2 * expected_tv(exact, n), (name, tv, expected_tv(exact, n))


def test_sampling_seeded_reproducible(client):
    for spec in PATHS.values():
        a = complete(client, temperature=0.9, seed=7, speculation=spec, max_tokens=12)
        b = complete(client, temperature=0.9, seed=7, speculation=spec, max_tokens=12)
        assert a["choices"][0]["token_ids"] == b["choices"][0]["token_ids"]


def test_draft_failure_degrades_to_plain(server, client):
    ref = complete(client, speculation=PLAIN, max_tokens=20)
    draft = __import__("ray").serve.get_deployment_handle("Draft", APP)
    failures = stats(server)["router"]["draft_failures"]
    draft.fail_next_proposals.remote(1).result(timeout_s=30)
    out = complete(client, speculation=SEPARATE, max_tokens=20)
    assert out["choices"][0]["token_ids"] == ref["choices"][0]["token_ids"]
    assert out["speculation"]["proposed_tokens"] == 0  # the first propose failed: plain for the rest
    assert stats(server)["router"]["draft_failures"] == failures + 1
    wait_idle(server)


# ---- regime-aware routing (mode auto), the regime map, metrics -----------------------------------------


def test_auto_speculates_single_greedy_request(client, server):
    out = complete(client, max_tokens=32, user="regime-single")  # no speculation field: mode auto
    spec = out["speculation"]
    assert (spec["pool"], spec["topology"], spec["mode"], spec["regime"]) == (
        "colocated", "colocated", "speculative", "favorable"), spec
    assert spec["adaptive_k"] and 1 <= spec["num_speculative_tokens"] <= 8
    assert spec["predicted_speedup"] > 1.05 and spec["batch"] == 1 and spec["mean_batch"] == 1.0  # alone throughout
    assert spec["costs_source"].startswith("file:")  # the replica's calibration reached the router
    assert spec["realised_speedup"] is not None and spec["realised_speedup"] > 0
    assert out["usage"]["completion_tokens"] == 32
    # the request's batch-1 steps reached the replica's drift correction (GET /v1/stats): counted,
    # or set aside as outliers against the test's calibration file, which another run measured
    drift = stats(server)["colocated"][0]["drift"]
    assert 0 in drift, drift
    assert drift[0]["plain_steps"] + drift[0]["spec_steps"] > 0 or drift[0]["outlier_rate"] > 0, drift
    # the same request, greedy: adaptive K changes nothing in the output
    ref = complete(client, max_tokens=32, speculation=PLAIN)
    assert out["choices"][0]["token_ids"] == ref["choices"][0]["token_ids"]
    assert ref["speculation"]["regime"] in ROUTING_REGIMES and ref["speculation"]["pool"] == "plain"
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


def test_auto_burst_goes_plain_in_large_batch_regime(server):
    """Concurrent auto requests, each its own traffic class (fresh `user`: acceptance = the prior):
    the first ones speculate; once both spec pools' batches pass break-even at a = 0.9 (under the
    synthetic costs co-located batch 7, separate 5 per Target replica, i.e. 8 sequences on its two;
    the served drift moves both a little) the rest go to the plain pool, labelled large_batch. The
    burst (30) is larger than the two pools' paying capacity plus the cost probes, so some must."""
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
    seen = [(s["pool"], s["batch"], s["probe"], s["regime"]) for s in specs]
    spec_pool = [s for s in specs if s["pool"] in ("colocated", "separate")]
    plain = [s for s in specs if s["pool"] == "plain" and not s["probe"]]  # a cost probe runs plain too
    assert spec_pool and all(s["regime"] == "favorable" and s["predicted_speedup"] > 1.05 for s in spec_pool), seen
    assert plain and all(s["regime"] == "large_batch" and s["num_speculative_tokens"] == 0 for s in plain), seen
    wait_idle(server)


ROUTING_REGIMES = ("favorable", "high_entropy", "expensive_draft", "domain_mismatch", "large_batch",
                   "orchestration_overhead", "long_context", "prefill_heavy", "no_gain", "unknown")


def test_regimes_endpoint(client):
    complete(client, user="regime-map")  # 24 tokens: enough decode steps to speculate
    m = client.get("/v1/regimes").json()
    assert set(m) >= {"draft", "costs", "k_max", "pools", "classes"}
    assert m["costs"]["calibrated"] and m["costs"]["hop_overhead_s"]["separate"] == pytest.approx(0.002)
    assert isinstance(m["costs"]["drift"], dict)
    assert set(m["pools"]) == {"plain", "colocated", "separate"}
    assert set(m["pools"]["plain"]) == {"active", "queued", "replicas", "capacity"}
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


# ---- errors, overload, disconnects ----------------------------------------------------------------


def _assert_error(r, status, param=None):
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    if param is not None:
        assert err["param"] == param, err


def test_errors(client):
    post = lambda body, path="/v1/completions": client.post(path, json={"model": "tiny", **body})
    _assert_error(post({"prompt": "x", "max_tokens": -1}), 400, "max_tokens")
    _assert_error(post({"prompt": "x", "temperature": 3.5}), 400, "temperature")
    _assert_error(post({"prompt": "x", "top_p": 0}), 400, "top_p")
    _assert_error(post({"prompt": "x", "n": 2}), 400, "n")
    _assert_error(post({"prompt": "x", "speculation": {"mode": "turbo"}}), 400, "speculation.mode")
    _assert_error(post({"prompt": "x", "speculation": {"mode": "plain", "topology": "separate"}}), 400,
                  "speculation")
    _assert_error(post({"prompt": "x", "speculation": {"num_speculative_tokens": 99}}), 400)
    _assert_error(post({"prompt": [5, -1, 3]}), 400, "prompt")
    _assert_error(post({"prompt": [5, 10**6]}), 400, "prompt")
    _assert_error(post({"prompt": ""}), 400, "prompt")
    _assert_error(post({"prompt": ["a", "b"]}), 400, "prompt")
    _assert_error(post({"messages": []}, "/v1/chat/completions"), 400, "messages")
    _assert_error(client.post("/v1/completions", content=b"{not json"), 400)
    _assert_error(post({"prompt": "x", "model": "gpt-4"}), 404, "model")
    _assert_error(post({"prompt": [7] * (MAX_LEN + 10)}), 413, "prompt")
    _assert_error(post({"prompt": [7] * 100, "max_tokens": MAX_LEN}), 400, "max_tokens")
    # the server still answers, correctly
    out = complete(client, max_tokens=4)
    assert out["usage"]["completion_tokens"] == 4


INTERNALS = re.compile(r"Traceback|File \"|\.py\b|site-packages|\bpid\b|[Aa]ctor|\b\d{1,3}(\.\d{1,3}){3}\b|"
                       + re.escape(str(local_app.ROOT)))
HOSTILE = [  # (what, request kwargs for client.request, expected status)
    ("top_k 2**64 sampled", {"json": {"prompt": "x", "top_k": 2**64, "temperature": 0.7}}, 400),
    ("top_k past the vocabulary", {"json": {"prompt": "x", "top_k": 10**9, "temperature": 0.7}}, 200),
    ("temperature 1e-300", {"json": {"prompt": "x", "temperature": 1e-300}}, 200),
    ("seed 2**64", {"json": {"prompt": "x", "seed": 2**64, "temperature": 0.7}}, 400),
    ("lone surrogate prompt", {"content": b'{"model": "tiny", "prompt": "a\\ud800b"}'}, 400),
    ("lone surrogate chat", {"content": b'{"model": "tiny", "messages": [{"role": "user", "content": "\\ud800"}]}',
                             "url": "/v1/chat/completions"}, 400),
    ("invalid UTF-8", {"content": b'{"model": "tiny", "prompt": "\xff\xfe"}'}, 400),
    ("empty stop", {"json": {"prompt": "x", "stop": [""]}}, 400),
    ("logit_bias", {"json": {"prompt": "x", "logit_bias": {"5": 10}}}, 400),
    ("tools", {"json": {"messages": [{"role": "user", "content": "hi"}], "tools": [{"type": "function"}]},
               "url": "/v1/chat/completions"}, 400),
    ("presence_penalty", {"json": {"prompt": "x", "presence_penalty": 1.0}}, 400),
    ("deeply nested", {"content": b'{"prompt": ' + b"[" * 50000 + b"]" * 50000 + b"}"}, 400),
    ("unparsable", {"content": b"{not json"}, 400),
    ("GET on a POST endpoint", {"method": "GET"}, 405),
    ("unknown path", {"url": "/v2/nothing", "method": "GET"}, 404),
    ("8 MB body", {"json": {"prompt": "word " * (8 << 18)}}, 413),
    ("64 KB of headers", {"json": {"prompt": "x"}, "headers": {"x-junk": "y" * (64 << 10)}}, 431),
]


def _hostile(client, kw: dict) -> httpx.Response:
    kw = dict(kw)
    method, url = kw.pop("method", "POST"), kw.pop("url", "/v1/completions")
    if "json" in kw:
        kw["json"] = {"model": "tiny", "max_tokens": 4, **kw["json"]}
    if "content" in kw:
        kw["headers"] = {"content-type": "application/json", **kw.get("headers", {})}
    return client.request(method, url, **kw)


def test_hostile_requests_hurt_no_one(server, client):
    """Hostile and malformed requests get a clean, OpenAI-shaped 4xx (or are served, when valid)
    with no internals in the answer, while a greedy stream on every path runs alongside and
    finishes whole with the same text as when served alone; /health keeps answering."""
    body = {"model": "tiny", "prompt": "It is a truth", "max_tokens": 60, "temperature": 0, "ignore_eos": True}
    solo = {name: complete(client, prompt=body["prompt"], max_tokens=60, speculation=spec)["choices"][0]["text"]
            for name, spec in PATHS.items()}

    async def innocent(name):
        async with httpx.AsyncClient(base_url=server["url"], timeout=120) as ac:
            async with ac.stream("POST", "/v1/completions", json={**body, "stream": True,
                                                                  "speculation": PATHS[name]}) as r:
                return sse_events([line async for line in r.aiter_lines()])

    async def scenario():
        streams = [asyncio.create_task(innocent(name)) for name in PATHS]
        answers = []
        for what, kw, _ in HOSTILE:
            answers.append(await asyncio.to_thread(_hostile, client, kw))
            assert (await asyncio.to_thread(client.get, "/health")).status_code == 200, what
        return answers, await asyncio.gather(*streams)

    answers, streams = asyncio.run(scenario())
    for (what, _, status), r in zip(HOSTILE, answers):
        assert r.status_code == status, (what, r.text[:300])
        assert r.headers.get("x-request-id"), what
        assert not INTERNALS.search(r.text), (what, r.text[:300])
        if status != 200:
            err = r.json()["error"]
            assert set(err) == {"message", "type", "param", "code"} and err["message"], what
    for name, events in zip(PATHS, streams):
        assert events[-1] == "[DONE]" and all("error" not in e for e in events[:-1]), name
        assert "".join(e["choices"][0]["text"] for e in events[:-1] if e["choices"]) == solo[name], name


def test_overload_503_and_disconnect_frees_everything(server):
    """Fill the bounded queue with long streams (co-located and separate: slow enough to still run
    when the extra request arrives), check 503 for one more, then drop every client mid-stream:
    sessions and KV slots must all come back."""
    paths = ["colocated" if i % 2 else "separate" for i in range(MAX_INFLIGHT)]
    before = stats(server)

    async def scenario():
        async with httpx.AsyncClient(base_url=server["url"], timeout=120) as ac:
            streams, responses = [], []
            for path in paths:
                req = ac.build_request("POST", "/v1/completions", json={
                    "model": "tiny", "prompt": "It is a truth", "max_tokens": 400, "temperature": 0,
                    "ignore_eos": True, "stream": True, "speculation": PATHS[path]})
                responses.append(ac.send(req, stream=True))
            responses = await asyncio.gather(*responses)
            for r in responses:
                assert r.status_code == 200
                lines = r.aiter_lines()
                while not (await lines.__anext__()).startswith("data: "):
                    pass
                streams.append(lines)
            busy = await asyncio.to_thread(stats, server)
            extra = await ac.post("/v1/completions", json={"model": "tiny", "prompt": "x", "max_tokens": 2})
            for r in responses:  # disconnect mid-stream
                await r.aclose()
            return busy, extra

    busy, extra = asyncio.run(scenario())
    assert busy["router"]["inflight"] == MAX_INFLIGHT
    assert busy["router"]["active"]["separate"] == paths.count("separate")
    assert sum(r["running"] for r in busy["colocated"]) >= 1
    assert sum(r["sessions"] for r in busy["target"]) >= 1
    _assert_error(extra, 503)
    assert extra.json()["error"]["code"] == "overloaded"
    after = wait_idle(server, timeout=60)
    aborted = lambda s: sum(r["aborted"] for r in s["plain"] + s["colocated"])
    assert aborted(after) - aborted(before) == paths.count("colocated")
    assert after["router"]["separate_aborted"] - before["router"]["separate_aborted"] == paths.count("separate")
    assert max(r["max_batch"] for r in after["target"]) >= 2  # verify calls of concurrent sessions fused
    with httpx.Client(base_url=server["url"], timeout=60) as c:
        assert complete(c, max_tokens=3)["usage"]["completion_tokens"] == 3


def test_nonstream_client_gone_frees_everything(server):
    """A non-streamed request whose client gives up mid-generation: Serve cancels the handler, the
    engine aborts (co-located) or the router releases both sides (separate). The client leaves once
    the router reports the request running, not after a fixed time."""
    before = stats(server)

    async def leave_mid_generation(spec, pool):
        async with httpx.AsyncClient(base_url=server["url"], timeout=120) as ac:
            call = asyncio.create_task(ac.post("/v1/completions", json={
                "model": "tiny", "prompt": "It is a truth", "max_tokens": 400, "temperature": 0,
                "ignore_eos": True, "speculation": spec}))
            while not (await asyncio.to_thread(stats, server))["router"]["active"][pool]:
                assert not call.done(), "the request finished before the client could leave"
                await asyncio.sleep(0.05)
            call.cancel()
            with pytest.raises(asyncio.CancelledError):
                await call

    for spec, pool in ((COLOCATED, "colocated"), (SEPARATE, "separate")):
        asyncio.run(leave_mid_generation(spec, pool))
    after = wait_idle(server, timeout=60)
    assert sum(r["aborted"] for r in after["colocated"]) == sum(r["aborted"] for r in before["colocated"]) + 1
    assert after["router"]["separate_aborted"] == before["router"]["separate_aborted"] + 1


# ---- session affinity and the 2.60 gather bug -----------------------------------------------------------


def test_session_affinity_gather_regression(server):
    """Concurrent pinned calls from inside one request (asyncio.gather in the Router replica):
    with the workaround (a fresh internal request id per call) they complete, and each session
    lands on the same replica every time; the replica set is the two Target replicas."""
    router = server["router"]
    sessions = [f"affinity-{i}" for i in range(12)]
    first = router.probe_sessions.remote("target", sessions).result(timeout_s=60)
    second = router.probe_sessions.remote("target", list(reversed(sessions))).result(timeout_s=60)
    assert "placement" in first and "placement" in second, (first, second)
    a = [p["replica"] for p in first["placement"]]
    b = [p["replica"] for p in reversed(second["placement"])]
    assert a == b
    from deployments.session_router import owner

    replicas = sorted({r["replica"] for r in stats(server)["target"]})
    assert len(replicas) == 2
    assert a == [owner(s, replicas) for s in sessions]  # rendezvous hashing, computable anywhere
    assert len(set(a)) == 2  # 12 sessions spread over both replicas (fixed ids: deterministic)
    draft = router.probe_sessions.remote("draft", sessions).result(timeout_s=60)
    assert len(draft["placement"]) == len(sessions)


@pytest.mark.skipif(__import__("ray").__version__ != "2.60.0", reason="documents the Ray 2.60 bug")
def test_gather_without_workaround_hangs_in_ray_2_60(server):
    """Canary: if this starts failing, Ray fixed the bug and pinned_gather's workaround can go."""
    out = server["router"].probe_sessions.remote(
        "target", [f"canary-{i}" for i in range(4)], fresh_ids=False, timeout_s=3.0).result(timeout_s=60)
    assert out == {"timed_out": True}
    # the router recovers: the same probe with the workaround works right after
    ok = server["router"].probe_sessions.remote("target", [f"canary-{i}" for i in range(4)]).result(timeout_s=60)
    assert len(ok["placement"]) == 4


def test_serve_load_generator_writes_its_report(server, tmp_path):
    """`specdec-bench serve` against the live app: one pass per mode, every request served."""
    from specdec_bench.cli import main

    main(["serve", "--url", server["url"], "--out", str(tmp_path), "--requests", "3", "--max-tokens", "8",
          "--modes", "plain", "colocated"])
    data = json.loads((tmp_path / "serve.json").read_text())
    assert [p["mode"] for p in data["passes"]] == ["plain", "colocated"]
    for p in data["passes"]:
        assert p["requests"] == p["completed"] == 3 and p["errors"] == 0 and p["output_throughput"] > 0, p
        assert 0 < p["median_ttft_ms"] <= p["p99_ttft_ms"] and 0 < p["median_tpot_ms"] <= p["p99_tpot_ms"], p
        # EOS may end one early
        assert 0 < p["total_output_tokens"] <= 3 * 8 and p["mean_e2el_ms"] > p["mean_ttft_ms"], p
    assert data["config"]["out"] == str(tmp_path)
    assert "| plain |" in (tmp_path / "serve.md").read_text()
