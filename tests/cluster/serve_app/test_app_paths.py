"""Every path (plain, co-located, separate) gives the same output: greedy across paths, streamed against
not, concurrent against solo, EOS and the context limit, sampling that follows the target's
distribution, a failed draft degrading to plain."""

from __future__ import annotations

import asyncio

import httpx
import pytest
import torch
from served import (
    APP,
    COLOCATED,
    EOS_AT,
    EOS_PROMPT,
    MAX_LEN,
    PATHS,
    PLAIN,
    SEPARATE,
    complete,
    greedy_ids,
    sse_events,
    stats,
    wait_idle,
)

pytestmark = pytest.mark.timeout(300)


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
