"""Logic of the Serve layer without a cluster: the route decision, session placement, the config,
and the separate topology's stopping rules."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest
from pydantic import ValidationError

from deployments.config import AppConfig, resolve_model_path
from deployments.router import (
    PoolLoad,
    RequestFeatures,
    RouteError,
    RouteSettings,
    SeparateRequest,
    choose_route,
)
from deployments.session_router import SessionAffinityRouter, owner
from specdec_core import SamplingParams

ALL = {"plain": PoolLoad(), "colocated": PoolLoad(), "separate": PoolLoad()}
S = RouteSettings(default_k=4, k_max=8, auto_max_running=4, auto_max_temperature=0.7)


def route(loads=ALL, **features):
    return choose_route(RequestFeatures(**features), loads, S)


def test_choose_route_auto_rule():
    d = route(temperature=0.0)
    assert (d.pool, d.topology, d.k) == ("colocated", "colocated", 4)
    d = route(temperature=1.0)
    assert (d.pool, d.topology, d.k, d.regime) == ("plain", None, 0, "high_entropy")
    busy = {**ALL, "colocated": PoolLoad(active=4)}
    d = route(busy, temperature=0.0)
    assert (d.pool, d.k, d.regime) == ("plain", 0, "large_batch")
    d = route({"plain": PoolLoad()}, temperature=0.0)
    assert (d.pool, d.k) == ("plain", 0)


def test_choose_route_explicit():
    assert route(mode="plain").pool == "plain"
    assert route(k=0).pool == "plain"
    d = route(mode="speculative", temperature=1.5)
    assert (d.pool, d.k) == ("colocated", 4)
    d = route(mode="speculative", topology="separate", k=6)
    assert (d.pool, d.topology, d.k) == ("separate", "separate", 6)
    d = route(topology="separate")  # a topology alone asks for speculation
    assert (d.pool, d.k) == ("separate", 4)
    d = route({"separate": PoolLoad()}, mode="speculative")
    assert d.pool == "separate"
    # plain decoding without a plain pool runs in a speculative pool with K=0
    d = route({"colocated": PoolLoad()}, mode="plain")
    assert (d.pool, d.topology, d.k) == ("colocated", None, 0)


@pytest.mark.parametrize("features", [
    {"mode": "turbo"}, {"k": 9}, {"k": -1}, {"topology": "remote"}, {"mode": "plain", "k": 2},
    {"mode": "plain", "topology": "separate"}, {"mode": "speculative", "k": 0}, {"topology": "colocated", "k": 0},
])
def test_choose_route_rejects(features):
    with pytest.raises(RouteError):
        route(**features)


def test_choose_route_missing_topology():
    with pytest.raises(RouteError):
        route({"plain": PoolLoad(), "colocated": PoolLoad()}, topology="separate")


def test_owner_is_stable_and_moves_only_lost_sessions():
    replicas = ["r1", "r2", "r3"]
    sessions = [f"s{i}" for i in range(300)]
    placed = {s: owner(s, replicas) for s in sessions}
    assert placed == {s: owner(s, list(reversed(replicas))) for s in sessions}  # order-free
    assert set(placed.values()) == set(replicas)
    after = {s: owner(s, ["r1", "r3"]) for s in sessions}
    assert all(after[s] == placed[s] for s in sessions if placed[s] != "r2")


def test_session_router_choose_replicas():
    router = object.__new__(SessionAffinityRouter)  # choose_replicas needs no router state
    reps = [SimpleNamespace(replica_id=SimpleNamespace(unique_id=u)) for u in ("aa", "bb", "cc")]

    def pending(session_id):
        return SimpleNamespace(metadata=SimpleNamespace(session_id=session_id),
                               routing_context=SimpleNamespace(should_backoff=False))

    for s in ("x", "y", "z", "w"):
        req = pending(s)
        ranks = asyncio.run(router.choose_replicas(reps, req))
        assert len(ranks) == 1 and len(ranks[0]) == 1
        assert ranks[0][0].replica_id.unique_id == owner(s, ["aa", "bb", "cc"])
        assert req.routing_context.should_backoff  # wait for the owner rather than spill
    assert asyncio.run(router.choose_replicas(reps, pending(""))) == [reps]
    assert asyncio.run(router.choose_replicas([], pending("x"))) == []


def test_app_config():
    cfg = AppConfig()
    assert cfg.has_plain and cfg.has_colocated and cfg.has_separate
    assert not AppConfig(draft=None).has_colocated
    with pytest.raises(ValidationError):
        AppConfig(no_such_option=1)
    with pytest.raises(ValidationError):
        AppConfig(default_k=9, k_max=8)
    with pytest.raises(ValidationError):
        AppConfig(draft_deployment={"num_replicas": 0})
    for name, field in AppConfig.model_fields.items():
        assert field.description, name
    assert resolve_model_path("no/such/model") == "no/such/model"
    assert resolve_model_path("tests").endswith("/tests")


class _Tok:
    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(ord("a") + i % 26) for i in ids)


def _req(**kw) -> SeparateRequest:
    return SeparateRequest("r", [1, 2], SamplingParams(**kw), _Tok(), eos_ids={99})


def test_separate_request_stopping_rules():
    r = _req(max_new_tokens=10)
    r.commit([0, 1, 99, 3])  # EOS ends the request and is not emitted
    assert (r.output_ids, r.finish_reason, r.tokens) == ([0, 1], "stop", [1, 2, 0, 1])
    r = _req(max_new_tokens=10, ignore_eos=True)
    r.commit([0, 99])
    assert r.output_ids == [0, 99] and not r.finished
    r = _req(max_new_tokens=3)
    r.commit([0, 1, 2, 3])  # a verify may emit past the budget: cut at it
    assert (r.output_ids, r.finish_reason) == ([0, 1, 2], "length")
    r = _req(max_new_tokens=10, stop=("cd",))
    r.commit([0, 1, 2, 3, 4])
    assert (r.finish_reason, r.delta()["text"]) == ("stop", "ab")
    r = _req(max_new_tokens=10)
    r.commit([0, 1])
    d = r.delta()
    assert (d["token_ids"], d["text"], d["finished"]) == ([0, 1], "ab", False)
    r.commit([2])
    assert r.delta()["token_ids"] == [2]
    assert r.budget_k(4, max_len=100) == 4
    assert r.budget_k(9, max_len=6) == 1  # 5 tokens held, room for 1 draft token
    r2 = _req(max_new_tokens=2)
    r2.commit([0])
    assert r2.budget_k(4, max_len=100) == 0  # one token left: a plain step emits it


def test_router_metrics_accept_zero_counts():
    from deployments.metrics import RouterMetrics

    m = RouterMetrics()
    m.finished("plain", 0, None, "length", {"output_tokens": 3, "proposed_tokens": 0, "accepted_tokens": 0,
                                            "verify_steps": 0}, 0.1)
    m.finished("colocated", 4, "colocated", "abort", {}, 0.1)
