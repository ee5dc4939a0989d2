"""Bounded traffic classes: a flood of distinct OpenAI `user` values cannot grow the router's
acceptance statistics, /v1/regimes or the metric label sets without bound."""

from __future__ import annotations

import pytest

from autoscaling.routing import PoolLoad
from autoscaling.traffic_classes import BUCKET_PREFIX, DEFAULT_DOMAIN, DomainTable
from deployments.regimes_map import regimes_map
from deployments.route_state import RouteState
from specdec_core.acceptance import AcceptanceTracker, TrafficClass


def test_rare_users_share_hashed_buckets():
    t = DomainTable(capacity=4, buckets=3, promote_after=2)
    assert t.assign(None).domain == t.assign("").domain == DEFAULT_DOMAIN
    first = t.assign("alice").domain
    assert first.startswith(BUCKET_PREFIX) and first == t.bucket("alice")
    assert DomainTable(buckets=3).bucket("alice") == first  # stable: no per-process hash salt
    assert len({t.bucket(f"u{i}") for i in range(100)}) == 3


def test_frequent_users_get_their_own_class_and_the_least_recent_is_demoted():
    t = DomainTable(capacity=2, buckets=2, promote_after=2)
    for user in ("a", "b"):
        assert t.assign(user).domain.startswith(BUCKET_PREFIX)
        assert t.assign(user).domain == user  # promoted on its second request
    assert t.assign("a").domain == "a"  # "a" is now the most recent: "b" goes first
    t.assign("c")
    got = t.assign("c")
    assert (got.domain, got.demoted) == ("c", "b")
    assert t.named == ["a", "c"]
    assert t.assign("b").domain.startswith(BUCKET_PREFIX)  # demoted: back to counting


def test_six_hundred_users_give_a_bounded_regime_map():
    tracker = AcceptanceTracker()
    st = RouteState("d", tracker, k_max=8, default_k=4, context_limit=512,
                    domains=DomainTable(capacity=8, buckets=4, promote_after=3), clock=lambda: 0.0)
    for _round in range(3):  # every user three times: all of them reach promotion
        for i in range(600):
            cls = st.traffic_class(0.0, f"user-{i}")
            tracker.observe(cls, 4, 2)
    domains = {c["domain"] for c in regimes_map(st, {"plain": PoolLoad()})["classes"]}
    assert len(domains) <= 1 + 8 + 4
    assert len(tracker.snapshot()["classes"]) <= 8 + 4


def test_metric_domain_labels_are_bounded():
    from deployments.metrics import RouterMetrics

    m = RouterMetrics(max_domain_labels=3)
    labels = [m._domain_label(f"u{i}") for i in range(10)]
    assert labels[:3] == ["u0", "u1", "u2"] and set(labels[3:]) == {"~other"}
    assert m._domain_label("u1") == "u1"
    m.acceptance(TrafficClass("d", "greedy", "u9"), 0.5, [0.5])  # exported under "~other"


@pytest.mark.parametrize("bad", [{"capacity": -1}, {"buckets": 0}, {"promote_after": 0}])
def test_table_refuses_nonsense(bad):
    with pytest.raises(ValueError):
        DomainTable(**bad)
