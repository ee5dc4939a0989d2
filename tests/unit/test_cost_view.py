"""One cost view: the router's routing decision and a replica's adaptive K price a request alike.

Measured before this view existed: the router sent auto requests to the co-located pool predicting
1.27x, and the replica's adaptive K then ran all 48 steps plain (it priced with its own acceptance
estimate and engine-step drift). Here the replica is given a deliberately different acceptance
history of its own: the request's class estimate and the router's drift travel with the request."""

from __future__ import annotations

import dataclasses
import itertools

import pytest

from autoscaling.routing import PoolLoad
from autoscaling.traffic_classes import DomainTable
from deployments.route_state import RouteState
from specdec_core import AcceptanceTracker, AdaptiveK, TrafficClass
from specdec_core.cost_view import CostView
from specdec_core.stats import RequestStats
from specdec_core.step_costs import StepCosts

BATCHES, QS = (1, 2, 4, 8, 16), (1, 2, 3, 5, 9)


def _costs(per_token: float, draft: float) -> StepCosts:
    """10 ms of overhead plus ``per_token`` per token in the forward; a draft forward of ``draft`` s."""
    return StepCosts(BATCHES, QS, tuple(tuple(0.010 + per_token * b * q for q in QS) for b in BATCHES),
                     tuple(draft for _ in BATCHES), context_len=64,
                     context_slope_s=tuple(2e-6 * q for q in QS), source="synthetic")


GREEDY, SAMPLED = _costs(0.0005, 0.003), _costs(0.0007, 0.0045)  # sampling costs more per step


def _router(a: float) -> RouteState:
    st = RouteState("d", AcceptanceTracker(prior_mean=a), k_max=8, default_k=4, context_limit=2048,
                    domains=DomainTable(promote_after=1), clock=lambda: 0.0)
    st.set_costs(GREEDY, "test", SAMPLED)
    return st


@pytest.mark.parametrize("drifted", [False, True])
def test_router_and_replica_reach_the_same_decision(drifted):
    agreed = {"speculate": 0, "plain": 0}
    for a, batch, temperature, prompt in itertools.product((0.2, 0.35, 0.5, 0.6, 0.7, 0.8, 0.9), (1, 2, 4, 8, 16),
                                                           (0.0, 1.0), (16, 700)):
        st = _router(a)
        if drifted:  # served spec steps ran 30% over their calibration at batch <= 2: the router learnt it
            for _ in range(40):
                st.drift.observe(0, 1.0, 1.0, batch=1)
                st.drift.observe(4, 1.3, 1.0, batch=1)
        cls = st.traffic_class(temperature, "u")
        features = st.features(temperature=temperature, top_p=1.0, max_tokens=200, prompt_tokens=prompt,
                               mode="auto", k=None, topology=None, objective="latency", cls=cls)
        route = st.decide(features, {"plain": PoolLoad(), "colocated": PoolLoad(active=batch - 1, capacity=32)})
        replica = AdaptiveK(CostView(GREEDY, SAMPLED), AcceptanceTracker(prior_mean=0.05), "d")  # its own: wrong
        replica.adopt_drift(st.drift)
        if route.pool == "colocated":
            assert route.adaptive
            first = replica.choose(None, cls, 0, 0, batch, route.decision.k, context_len=prompt,
                                   class_estimate=a)
            second = replica.choose(first, cls, 0, 0, batch, route.decision.k, context_len=prompt + 1,
                                    class_estimate=a)
            assert first.k > 0 and second.k > 0, (a, batch, temperature, prompt, route.decision)
            agreed["speculate"] += 1
        else:
            # Asked to price the same request from scratch, the replica keeps it plain too.
            replica.tracker = AcceptanceTracker(prior_mean=a)
            k = replica.choose(None, cls, 0, 0, batch, 8, context_len=prompt).k
            assert k == 0, (a, batch, temperature, prompt, route.decision)
            agreed["plain"] += 1
    assert min(agreed.values()) > 20, agreed  # both outcomes occur on the grid


def test_the_replica_prices_with_the_routers_drift():
    """An adaptive request carries the router's drift; the replica prices with it and stops learning
    its own, so the two views cannot drift apart."""
    st = _router(0.7)
    replica = AdaptiveK(CostView(GREEDY, SAMPLED), AcceptanceTracker(), "d")
    cls = st.traffic_class(0.0, "u")
    replica.observe_step([cls], 64, 4, 1.0)
    assert replica.view.drift.buckets  # on its own it learns from its steps
    replica.adopt_drift(st.drift)
    replica.observe_step([cls], 64, 4, 1.0)
    assert replica.view.drift.buckets is st.drift.buckets and not st.drift.buckets
    calibrated = st.cost_model().plain_time_per_token(1)
    spec = RequestStats(prompt_tokens=16, output_tokens=8)
    for _ in range(3):
        spec.record_verify(4, 2)
    for _ in range(40):  # served plain steps 1.5x their calibration, spec steps as calibrated
        st.observe_timing("plain", 1, RequestStats(plain_steps=9, prompt_tokens=16, output_tokens=8),
                          1.5 * calibrated, cls)
        st.observe_timing("colocated", 1, spec, st.cost_model(True, 20).spec_step_time(1, 4) / 3, cls)
    assert st.cost_model().plain_time_per_token(1) == pytest.approx(1.5 * calibrated, rel=0.05)
    assert replica.cost_model_for(cls).plain_time_per_token(1) == st.cost_model().plain_time_per_token(1)


def test_a_batch_of_both_paths_is_priced_by_its_share_of_sampled_rows():
    """The verifier takes each row's own path (argmax or rejection sampling) in one step, so a batch of half
    greedy, half sampled rows costs half way between the two calibrations, not all sampled."""
    view = CostView(GREEDY, SAMPLED)
    greedy, sampled = TrafficClass.of("d", 0.0), TrafficClass.of("d", 1.0)
    half = view.model_for_batch([greedy, sampled] * 2, 64)
    for ks in ([0] * 4, [2] * 4, [1, 3, 0, 2]):
        low, high = (view.model(g, 64).ragged_step_time(4, ks, calibrated=True) for g in (True, False))
        assert low < high
        assert half.ragged_step_time(4, ks, calibrated=True) == pytest.approx((low + high) / 2)
    assert view.model_for_batch([greedy] * 4, 64) is view.model(True, 64)
    assert view.model_for_batch([sampled] * 4, 64) is view.model(False, 64)
    with pytest.raises(ValueError, match="one grid"):
        GREEDY.blend(dataclasses.replace(SAMPLED, batches=(1, 2, 4, 8, 32)), 0.5)


def test_a_mixed_batch_is_planned_and_learnt_at_one_price():
    """A mixed batch's steps are planned and learnt at its blended price. Before, a plan priced the batch on
    the sampling path while its steps were learnt against its first row's path (greedy): steps that ran
    exactly at the blended price looked slow, speculative ones more than plain ones, and the drift priced
    speculation dearer still on top of the sampling path's price."""
    policy = AdaptiveK(CostView(GREEDY, SAMPLED), AcceptanceTracker(), "d", budgeted=True)
    rows = [TrafficClass.of("d", 0.0), TrafficClass.of("d", 1.0)] * 2
    for cls in set(rows):
        for _ in range(40):
            policy.observe(cls, 4, 4)
    half = CostView(GREEDY, SAMPLED).model_at(0.5, 64)
    batch = dict(classes=rows, evidence=[([], [], None)] * 4, k_maxes=[4] * 4, fixed=[None] * 4, context_len=64,
                 plain_runs=[0] * 4, catch_up=[1] * 4, remaining=[64] * 4)
    for _ in range(2):  # before any step is learnt, and after 40 of each kind that ran at that price
        plan = policy.plan_budget(**batch)
        assert max(plan.ks) > 0
        assert plan.step_s == pytest.approx(half.ragged_step_time(4, plan.ks, calibrated=True))
        for _ in range(40):
            for ks in ([0] * 4, plan.ks):
                policy.observe_ragged_step(rows, 64, list(ks), half.ragged_step_time(4, ks, calibrated=True))
