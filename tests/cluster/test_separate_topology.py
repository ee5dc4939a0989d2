"""The separate topology on a served app of its own (only the separate pool deployed): batched steps
that requests join and leave, overlapped rounds (PEARL's post-verify, deployments/separate_loop.py),
adaptive K, and sessions released when a channel closes. The draft agrees with the target only
partly (a noisy copy of it), so that the target accepts whole proposals often enough for overlapped
proposals to be kept, and rejects often enough for the sequential path to run too."""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest
import torch
from distributions import exact_marginals, expected_tv
from served import running_app

pytestmark = pytest.mark.timeout(300)

APP = "separate"
PROMPT = [7, 3, 11]


@pytest.fixture(scope="module")
def server(tiny_models, noisy_draft):
    small = {"num_cpus": 0.1}
    args = {"target": tiny_models["target"], "draft": noisy_draft, "model_name": "tiny", "max_model_len": 128,
            "separate_overlap": "always", "acceptance_prior": 0.9, "traffic_class_promote_after": 1,
            "router": small, "draft_deployment": small, "target_deployment": small,
            "plain": {"num_replicas": 0}, "colocated": {"num_replicas": 0}}
    with running_app(args, APP) as app:
        yield app


def target_greedy(model_path: str, n: int) -> list[int]:
    """The target's own greedy continuation of PROMPT, ``n`` tokens, without stopping at EOS."""
    from transformers import AutoModelForCausalLM

    model, want = AutoModelForCausalLM.from_pretrained(model_path), []
    with torch.no_grad():
        for _ in range(n):
            want.append(int(model(torch.tensor([PROMPT + want])).logits[0, -1].argmax()))
    return want


def pool_stats(server) -> dict:
    return server["router"].pool_stats.remote().result(timeout_s=60)


def overlap_counters(server) -> dict:
    return pool_stats(server)["router"]["separate_overlap"]


def sample(server, n: int, k: int, max_tokens: int, **knobs) -> list[dict]:
    spec = {"mode": "speculative", "topology": "separate", "num_speculative_tokens": k}

    async def run():
        async with httpx.AsyncClient(base_url=server["url"], timeout=120) as ac:
            limit = asyncio.Semaphore(12)

            async def one(seed):
                async with limit:
                    r = await ac.post("/v1/completions", json={
                        "model": "tiny", "prompt": PROMPT, "max_tokens": max_tokens, "seed": seed,
                        "ignore_eos": True, "return_token_ids": True, "speculation": spec, **knobs})
                    assert r.status_code == 200, r.text
                    return r.json()
            return await asyncio.gather(*(one(seed) for seed in range(n)))

    return asyncio.run(run())


def test_overlapped_rounds_follow_the_target_distribution(server, tiny_models):
    """K=1, 4 tokens, T=1 with top-k and top-p. Where the target accepts the first proposal, the
    proposal the Draft made meanwhile is what the next verify judges for token 3 (the bonus token
    dropped). Tokens 3 and 4 over 2000 seeded requests match the target's exact marginals, and a
    good share of the rounds kept their overlapped proposal."""
    n, knobs = 2000, {"temperature": 1.0, "top_k": 8, "top_p": 0.9}
    exact = exact_marginals(tiny_models["target"], PROMPT, 4, **knobs)
    before = overlap_counters(server)
    outs = sample(server, n, 1, 4, **knobs)
    after = overlap_counters(server)
    assert after["kept"] - before["kept"] >= n // 4, (before, after)
    for position in (2, 3):
        hist = torch.bincount(torch.tensor([o["choices"][0]["token_ids"][position] for o in outs]),
                              minlength=exact[position].numel()) / n
        tv = 0.5 * (hist - exact[position]).abs().sum().item()
        assert tv < 2 * expected_tv(exact[position], n), (position, tv, expected_tv(exact[position], n))


def test_overlapped_greedy_equals_the_target_greedy(server, tiny_models):
    """Greedy with K=3 over 40 tokens: the output is the target's own greedy continuation, token
    for token, with overlapped proposals kept along the way."""
    want = target_greedy(tiny_models["target"], 40)
    before = overlap_counters(server)
    outs = sample(server, 4, 3, 40, temperature=0.0)
    assert all(o["choices"][0]["token_ids"] == want for o in outs), ([o["choices"][0]["token_ids"] for o in outs], want)
    assert overlap_counters(server)["kept"] > before["kept"]


def test_auto_requests_run_adaptive_k_in_the_separate_loop(server, tiny_models):
    """mode=auto on an app whose only speculative pool is the separate topology: a request of a
    fresh traffic class (the app's prior: acceptance 0.9) runs there with adaptive K (re-chosen each
    round from the cost model) and its greedy output is the target's own."""
    want = target_greedy(tiny_models["target"], 24)
    with httpx.Client(base_url=server["url"], timeout=120) as client:
        r = client.post("/v1/completions", json={"model": "tiny", "prompt": PROMPT, "max_tokens": 24, "temperature": 0,
                                                 "ignore_eos": True, "return_token_ids": True, "user": "auto-test",
                                                 "speculation": {"mode": "auto"}})
    assert r.status_code == 200, r.text
    spec = r.json()["speculation"]
    assert (spec["pool"], spec["adaptive_k"]) == ("separate", True), spec
    assert spec["proposed_tokens"] > 0 and r.json()["choices"][0]["token_ids"] == want


def test_sessions_of_a_router_that_is_gone_are_released(server):
    """A channel's owner (a Router) that dies cannot release its sessions: the Target releases the
    sessions a closed channel's steps opened. Here a stand-in owner opens a session over the Target's
    channel, as the Router's loop does, then goes away."""
    from ray import serve

    from deployments.channel import Channel
    from deployments.messages import TARGET_METHODS, SessionContext, VerifyStepItem
    from specdec_core import SamplingParams

    target = serve.get_deployment_handle("Target", APP)

    def sessions() -> int:
        return target.options(session_id="probe").stats.remote().result(timeout_s=30).sessions

    address = target.options(session_id="orphan").channel.remote().result(timeout_s=30)
    before = sessions()

    async def open_and_leave():
        ch = await Channel.open(address, TARGET_METHODS)
        item = VerifyStepItem(SessionContext("orphan", 0, list(PROMPT), SamplingParams(max_new_tokens=4)), None)
        (result,) = await ch.call("step", [item], 30.0)
        assert len(result.emitted) == 1  # the prefill ran: the session holds a KV slot
        assert await asyncio.to_thread(sessions) == before + 1
        ch.close()

    asyncio.run(open_and_leave())
    deadline = time.time() + 30
    while sessions() != before:
        assert time.time() < deadline, "the closed channel's session was never released"
        time.sleep(0.2)


def test_requests_share_steps_and_join_and_leave(server):
    """Separate requests of different lengths, each starting while others run: every output equals
    the request's output alone, and the Target ran them in shared steps (fewer step messages than
    the requests' steps alone, more than one session in a step); every session is released after."""
    jobs = [(f"Separate {i}: it is a truth", 6 + 5 * i) for i in range(8)]

    def target_steps() -> int:
        return sum(r["batches"] for r in pool_stats(server)["target"])

    async def run(concurrent: bool):
        async with httpx.AsyncClient(base_url=server["url"], timeout=120) as ac:
            async def one(i, prompt, n):
                if concurrent:
                    await asyncio.sleep(0.05 * i)  # join while the others run
                r = await ac.post("/v1/completions", json={
                    "model": "tiny", "prompt": prompt, "max_tokens": n, "temperature": 0, "ignore_eos": True,
                    "return_token_ids": True,
                    "speculation": {"mode": "speculative", "topology": "separate", "num_speculative_tokens": 4}})
                assert r.status_code == 200, r.text
                return r.json()["choices"][0]["token_ids"]
            if concurrent:
                return await asyncio.gather(*(one(i, p, n) for i, (p, n) in enumerate(jobs)))
            return [await one(i, p, n) for i, (p, n) in enumerate(jobs)]

    t0 = target_steps()
    alone = asyncio.run(run(False))
    t1 = target_steps()
    together = asyncio.run(run(True))
    t2 = target_steps()
    assert together == alone
    assert [len(o) for o in alone] == [n for _, n in jobs]
    assert t2 - t1 < t1 - t0, (t1 - t0, t2 - t1)
    assert max(r["max_batch"] for r in pool_stats(server)["target"]) > 1
    deadline = time.time() + 30
    while any(r["sessions"] for side in ("draft", "target") for r in pool_stats(server)[side]):
        assert time.time() < deadline, "sessions still held after every request ended"
        time.sleep(0.2)


def test_channel_ports_of_a_running_service_refuse_unauthenticated_bytes(server, tiny_models, tmp_path):
    """On the served app: while greedy separate requests run, connections to the Draft's and the
    Target's channel ports send a pickle that would run a command, random bytes, a wrong token and a
    frame header of 4 GiB after the right token. None of it is decoded or run (the command's file
    never appears), each such connection is closed, and every request finishes with the target's own
    greedy output."""
    import os
    import pickle
    import struct

    from ray import serve

    marker = tmp_path / "pwned"

    class Exploit:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))

    addresses = [serve.get_deployment_handle(name, APP).options(session_id=f"probe-{name}").channel.remote()
                 .result(timeout_s=30) for name in ("Draft", "Target")]
    attacks = [struct.pack("!I", 200) + pickle.dumps(Exploit()), os.urandom(2048),
               bytes(b ^ 0xFF for b in addresses[0].token) + b"\0\0\0\1x"]

    async def attack(address, payload) -> bytes:
        reader, writer = await asyncio.open_connection(address.host, address.port)
        writer.write(payload)
        try:
            return await asyncio.wait_for(reader.read(), 15)  # b"": the replica closed the connection
        finally:
            writer.close()

    async def all_attacks():
        await asyncio.sleep(0.3)  # while the requests run
        return await asyncio.gather(*(attack(a, p) for a in addresses for p in
                                      attacks + [a.token + struct.pack("!I", (4 << 30) - 1)]))

    async def both():
        requests = asyncio.to_thread(sample, server, 6, 3, 32, temperature=0.0)
        return await asyncio.gather(requests, all_attacks())

    outs, answers = asyncio.run(both())
    want = target_greedy(tiny_models["target"], 32)
    assert answers == [b""] * len(answers)
    assert not marker.exists()
    assert all(o["choices"][0]["token_ids"] == want for o in outs)
    assert all(o["speculation"]["proposed_tokens"] > 0 for o in outs)
