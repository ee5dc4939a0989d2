"""What the served-app tests share: the app's arguments on the tiny models, the synthetic step costs
the regime tests route on (the unit tests of the router's state too), and the HTTP and stats helpers (a
helper module, not a test module)."""

from __future__ import annotations

import json
import socket
import time

import pytest

from specdec_bench import local_app
from specdec_bench.local_app import free_port, sse_event, sse_events  # noqa: F401 - the tests' helpers, one copy

MAX_LEN = 512
MAX_INFLIGHT = 32
APP = "specdec"

PLAIN = {"mode": "plain"}
COLOCATED = {"mode": "speculative", "topology": "colocated", "num_speculative_tokens": 4}
SEPARATE = {"mode": "speculative", "topology": "separate", "num_speculative_tokens": 4}
PATHS = {"plain": PLAIN, "colocated": COLOCATED, "separate": SEPARATE}


def running_app(args: dict, app: str = APP, metrics_port: int | None = None):
    """A local Ray cluster (2 CPUs) serving ``build_app(args)`` as ``app`` on a free 127.0.0.1 port,
    shut down on exit: {"url", "router"}."""
    return local_app.running_app(args, app, metrics_port)


# The regime tests need a cost model under which this 2-core machine is compute bound at a small
# batch, and a draft the router believes in. Honest stand-ins, both through documented config keys:
# - calibration_file: synthetic step costs for the tiny pair, t_T(b, q) = 10 ms + 4 ms * b * q and
#   t_D = 3 ms (a forward that turns compute bound near 8 tokens, like docs/ARCHITECTURE.md (Facts)'s CPU
#   table does near 64-128): the co-located replica loads them instead of calibrating (which would
#   also add seconds to start-up), and the router fetches them from it.
# - acceptance_prior 0.9: the prior of a fresh traffic class (the random tiny draft really agrees
#   with the target far less; tests that need the prior use a fresh `user`, i.e. a fresh class).
# With a = 0.9 speculation then pays at batch <= 6 (K=1: 1.06x at batch 6) and not from batch 7 on.
ACCEPTANCE_PRIOR = 0.9
# The proxy's header timeout for the served-app tests (deployments/proxy_edge.py), short enough for a test.
HEADER_TIMEOUT_S = 2.0
# A request without ignore_eos must end at EOS on every path. The random tiny target never emits
# its EOS token early, so the served app's copy of it also lists as EOS (generation_config.json, read by
# the engines and the router alike) the token its greedy output for EOS_PROMPT has at EOS_AT.
EOS_PROMPT, EOS_AT = [9, 4, 21], 5


def greedy_ids(model_path: str, prompt: list[int], n: int) -> list[int]:
    """transformers' own greedy continuation of ``prompt``."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_path)
    out = model.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def synthetic_costs():
    from specdec_core.step_costs import StepCosts

    batches, qs = (1, 2, 4, 8, 16, 32), (1, 2, 3, 5, 9)
    return StepCosts(batches, qs, tuple(tuple(0.010 + 0.004 * b * q for q in qs) for b in batches),
                     tuple(0.003 for _ in batches), source="synthetic-test")


class CharTokenizer:
    """A tokenizer stand-in for requests built without a model: token i decodes to a letter."""

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(ord("a") + i % 26) for i in ids)


def app_args(models: dict, calibration_file: str | None = None) -> dict:
    small = {"num_cpus": 0.1}
    return {
        "target": models["target"],
        "draft": models["draft"],
        "model_name": "tiny",
        "max_model_len": MAX_LEN,
        "max_inflight_requests": MAX_INFLIGHT,
        "calibration_file": calibration_file,
        "acceptance_prior": ACCEPTANCE_PRIOR,
        "traffic_class_promote_after": 1,  # each test's `user` is a class of its own at once
        "router": small,
        "plain": small,
        "colocated": small,
        "draft_deployment": small,
        "target_deployment": {"num_cpus": 0.1, "num_replicas": 2},
        # Every separate round overlaps the next proposal with its verify where it can (the synthetic
        # costs would never let `auto` overlap: their verify dwarfs the draft), so every separate
        # test runs the overlapped path; each rejection still sends a round through the sequential one.
        "separate_overlap": "always",
    }


def complete(client, prompt="It is a truth universally", **kw) -> dict:
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 24, "temperature": 0, "ignore_eos": True,
            "return_token_ids": True, **kw}
    r = client.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    return r.json()


def streamed_token_ids(client, speculation: dict, prompt="It is a truth universally", max_tokens=24) -> list[int]:
    """The greedy token ids of one streamed completion; asserts the stream ended with [DONE]."""
    body = {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "return_token_ids": True, "stream": True, "speculation": speculation}
    with client.stream("POST", "/v1/completions", json=body) as r:
        events = sse_events(r.iter_lines())
    assert events[-1] == "[DONE]"
    return [t for e in events[:-1] if e["choices"] for t in e["choices"][0].get("token_ids") or []]


def raw_answer(url: str, raw: bytes) -> bytes:
    """What the server at ``url`` answers on a fresh connection to ``raw``, until it closes the connection."""
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=30) as s:
        s.sendall(raw)
        out = b""
        while chunk := s.recv(65536):
            out += chunk
    return out


def stats(server) -> dict:
    return server["router"].pool_stats.remote().result(timeout_s=60)


def wait_idle(server, timeout=30.0) -> dict:
    """Poll until every replica holds no session, runs nothing and has all KV slots free."""
    deadline = time.time() + timeout
    while True:
        s = stats(server)
        engine = s["plain"] + s["colocated"]
        busy = (
            s["router"]["inflight"] or s["router"]["background"] or any(s["router"]["active"].values())
            or any(r["running"] or r["waiting"] or r["sessions"] or r["streams"] or r["free_slots"] != r["total_slots"]
                   for r in engine)
            or any(r["draft_free_slots"] not in (None, r["total_slots"]) for r in engine)
            or any(r["sessions"] or r["free_slots"] != r["total_slots"] for r in s["draft"] + s["target"])
        )
        if not busy:
            return s
        if time.time() > deadline:
            pytest.fail(f"replicas did not return to idle: {json.dumps(s)}")
        time.sleep(0.2)



