"""The router's state without a cluster (``deployments/route_state.py``): the context it builds for
``route()`` from the pools' loads, the acceptance tracker and the costs; explicit fields and fallbacks;
the regime map of ``/v1/regimes``; how the budgeted pool, the separate topology and pools on shared cores
are priced. What requests teach it is ``test_route_lessons.py``."""

from __future__ import annotations

import dataclasses

import pytest
from routes import ALL, route, route_state
from served import CharTokenizer, synthetic_costs

from autoscaling.routing import PoolLoad, RoutingError
from deployments.regimes_map import regimes_map
from deployments.route_state import PRIOR_COSTS, objective_of, with_hops
from specdec_core import SamplingParams
from specdec_core.acceptance import AcceptanceTracker, TrafficClass
from specdec_core.stats import RequestStats
from specdec_core.step_costs import StepCosts


def test_glue_context_from_loads_tracker_costs():
    st = route_state(a=0.8, evidence=100, costs=synthetic_costs())
    cls = st.traffic_class(0.0, None)
    assert cls == TrafficClass("d", "greedy", "default")
    f = st.features(temperature=0.0, top_p=1.0, max_tokens=64, prompt_tokens=8, mode="auto", k=None,
                    topology=None, objective="latency", cls=cls)
    ctx = st.context(f, {"plain": PoolLoad(), "colocated": PoolLoad(active=3)})
    assert set(ctx.cost_models) == {"colocated"}  # only deployed spec pools are priced
    assert ctx.acceptance == pytest.approx(st.tracker.estimate(cls)) and ctx.evidence == pytest.approx(100)
    assert ctx.loads["colocated"].joined_batch() == 4 and ctx.k_max == 8 and ctx.context_limit == 512
    assert ctx.cost_models["colocated"].costs.hop("separate") == pytest.approx(0.002)  # measured hops added
    # explicit speculation without K takes default_k
    assert st.features(temperature=0.0, top_p=1.0, max_tokens=8, prompt_tokens=1, mode="speculative", k=None,
                       topology=None, objective="latency", cls=cls).k == 4


def test_glue_routes_auto_by_load_and_regime():
    r = route()
    assert (r.pool, r.decision.regime, r.adaptive, r.batch) == ("colocated", "favorable", True, 1)
    assert r.decision.k > 0 and r.decision.predicted_speedup > 1.05
    busy = {**ALL, "colocated": PoolLoad(active=12), "separate": PoolLoad(active=12)}
    r = route(busy)
    assert (r.pool, r.decision.k, r.decision.regime) == ("plain", 0, "large_batch")
    assert route(objective="throughput").pool == "plain"
    assert objective_of(None, "flex") == "throughput" and objective_of(None, "default") == "latency"
    assert objective_of("latency", "batch") == "latency"
    low = route_state(a=0.1, evidence=200, costs=synthetic_costs())
    r = route(state=low)
    assert (r.pool, r.decision.regime) == ("plain", "domain_mismatch")
    r = route(state=low, temperature=1.0)  # a separate class: no evidence, prior only
    assert r.pool == "plain"
    assert route(max_tokens=4).decision.regime == "prefill_heavy"


def test_glue_explicit_and_fallbacks():
    assert route(mode="plain").pool == "plain"
    r = route(mode="speculative", temperature=1.5)
    assert (r.pool, r.decision.k, r.adaptive) == ("colocated", 4, False)  # explicit K stays fixed
    r = route(mode="speculative", topology="separate", k=6)
    assert (r.pool, r.decision.topology, r.decision.k, r.adaptive) == ("separate", "separate", 6, False)
    assert route(topology="separate").decision.k == 4
    r = route({"colocated": PoolLoad()}, mode="plain")  # no plain pool: a spec pool decodes with K=0
    assert (r.pool, r.decision.topology, r.decision.k) == ("colocated", None, 0)
    with pytest.raises(RoutingError):
        route({"plain": PoolLoad(), "colocated": PoolLoad()}, topology="separate")


def test_speculation_in_a_pool_that_is_down_decodes_plain_on_one_that_is_up():
    """The separate pool lost its replica (routing sees no load for it): a request for it runs plain and
    says why; with no pool up at all, 503 with Retry-After."""
    from deployments.api import APIError
    from deployments.planning import _plain_while_down

    st = route_state(costs=synthetic_costs())
    f = st.features(temperature=0.0, top_p=1.0, max_tokens=64, prompt_tokens=8, mode="speculative", k=None,
                    topology="separate", objective="latency", cls=st.traffic_class(0.0, None))
    up = {"plain": PoolLoad(), "colocated": PoolLoad()}
    with pytest.raises(RoutingError):
        st.decide(f, up)
    r = _plain_while_down(st, f, up, {"separate"}, "r1")
    assert (r.pool, r.decision.k, r.adaptive) == ("plain", 0, False)
    assert "separate down" in r.decision.reason
    with pytest.raises(APIError) as err:
        _plain_while_down(st, f, {}, {"separate", "plain", "colocated"}, "r2")
    assert err.value.status == 503 and "Retry-After" in err.value.headers


@pytest.mark.parametrize("features", [
    {"mode": "turbo"}, {"k": 9}, {"k": -1}, {"topology": "remote"}, {"mode": "plain", "k": 2},
    {"mode": "plain", "topology": "separate"}, {"mode": "speculative", "k": 0}, {"topology": "colocated", "k": 0},
])
def test_route_decision_rejects(features):
    with pytest.raises(RoutingError):
        route(**features)


def test_glue_observe_and_regimes_map():
    st = route_state(a=0.6)
    assert st.costs_source.startswith("prior") and not st.calibrated
    cls = st.traffic_class(0.0, "code")
    # a request: K=4, steps accepted 4, 1, 0 -> judged per position [3, 2, 1, 1], accepted [2, 1, 1, 1]
    stats = RequestStats(proposed_per_position=[3, 2, 1, 1], accepted_per_position=[2, 1, 1, 1], verify_steps=3)
    st.observe(cls, stats)
    assert st.tracker.evidence(cls) == pytest.approx(7)
    assert st.tracker.estimate(cls) == pytest.approx((0.6 * 20 + 5) / 27)
    st.observe(cls, RequestStats())  # plain request: nothing
    assert st.tracker.evidence(cls) == pytest.approx(7)
    st.set_costs(synthetic_costs(), "calibrated:cpu")
    m = regimes_map(st, {"plain": PoolLoad(active=2), "colocated": PoolLoad(active=30)})
    assert m["costs"]["calibrated"] and m["pools"]["colocated"]["active"] == 30
    keys = [(c["temperature_bucket"], c["domain"]) for c in m["classes"]]
    assert keys == [("greedy", "code"), ("greedy", "default")]
    for c in m["classes"]:
        assert {"acceptance", "evidence", "per_position", "cost_ratio_batch1", "break_even_batch",
                "choice"} <= set(c)
        assert c["cost_ratio_batch1"] == pytest.approx(0.003 / 0.014)
        assert c["choice"]["pool"] in ("plain", "colocated") and c["choice"]["regime"]
    assert m["classes"][1]["choice"]["pool"] == "colocated"  # batch 1: the load of the pool is ignored
    assert st.realised_speedup(1, 0.007) == pytest.approx(2.0)
    assert m["costs"]["drift"] == {}
    st.observe_timing("plain", 1, RequestStats(plain_steps=9), 1.2 * st.cost_model().plain_time_per_token(1))
    drift = regimes_map(st, {"plain": PoolLoad()})["costs"]["drift"]
    assert drift[0]["plain_steps"] == 1 and drift[0]["plain"] > 1.0 and drift[0]["spec_steps"] == 0


def test_regimes_map_has_a_context_axis():
    """Per class, the regime along the context: with a per-row slope that grows with the verify width
    (attention compute bound, as on this CPU) the batch-1 speedup falls with the context."""
    costs = dataclasses.replace(synthetic_costs(), context_slope_s=tuple(2e-6 * q for q in (1, 2, 3, 5, 9)))
    st = route_state(a=0.9, costs=costs)
    axis = regimes_map(st, {"plain": PoolLoad(), "colocated": PoolLoad()})["classes"][0]["by_context"]
    assert [e["context"] for e in axis] == [128, 256]  # below the context limit, 512
    assert axis[0]["predicted_speedup_batch1"] > axis[1]["predicted_speedup_batch1"] > 1
    assert all(e["break_even_batch"] is None or e["break_even_batch"] >= 1 for e in axis)


def test_prior_costs_and_hops():
    assert PRIOR_COSTS.target_time(32, 9) > 3 * PRIOR_COSTS.target_time(32, 1)
    assert with_hops(PRIOR_COSTS, 0.02).hop("separate") == 0.02


def test_a_budgeted_pool_is_routed_on_what_its_planner_will_do():
    """With budgeted verification the co-located replica plans every step for its batch (K per row,
    a 10% margin over a plain step): the router prices the pool with that plan, not with one K per
    request, so the two agree on where speculation runs (and /v1/regimes says the same)."""
    from specdec_core.step_planner import budgeted_choice

    costs = synthetic_costs()
    differ = 0
    for active in range(0, 12):
        loads = {"plain": PoolLoad(), "colocated": PoolLoad(active=active)}
        per_request = route(loads, state=route_state(costs=costs))
        budgeted = route(loads, state=route_state(costs=costs, budgeted=True))
        plan = budgeted_choice(route_state(costs=costs).cost_model(), active + 1, (0.9,) * 8)
        assert (budgeted.pool == "colocated") == (plan.k > 0), (active, budgeted.decision)
        if budgeted.pool == "colocated":
            assert budgeted.decision.k == plan.k
            assert budgeted.decision.predicted_speedup == pytest.approx(plan.predicted_speedup)
        differ += (per_request.pool, per_request.decision.k) != (budgeted.pool, budgeted.decision.k)
    assert differ  # the plan's pricing is not one K per request's
    regimes = regimes_map(route_state(costs=costs, budgeted=True), {"plain": PoolLoad(), "colocated": PoolLoad()})
    cls = regimes["classes"][0]
    plan1 = budgeted_choice(route_state(costs=costs).cost_model(), 1, (cls["acceptance"],) * 8)
    assert (cls["best_k_batch1"], cls["predicted_speedup_batch1"]) == (plan1.k, pytest.approx(plan1.predicted_speedup))


def test_separate_overlap_and_k_from_the_cost_model():
    """The separate loop's choices, in Theorem 3.8's world (a verify costs one plain step, 1 s; a
    draft forward c s): overlap where the draft is as costly as the verify and acceptance is high,
    not where most overlapped proposals would be dropped; an adaptive request's first K is the
    engines' own AdaptiveK's, priced for the separate topology, and follows new costs."""
    from specdec_core.costmodel import CostModel
    from specdec_core.scheduler import ScheduledRequest

    def costs(c):
        return StepCosts((1, 64), (1, 9), ((1.0, 1.0), (1.0, 1.0)), (c, c), source="leviathan")

    def req(params, accepted=0, judged=()):
        r = ScheduledRequest("r", list(range(64)), params, CharTokenizer(), {99})
        r.stats.accepted, r.stats.proposed_per_position = accepted, list(judged)
        return r

    high, low = (SamplingParams(num_speculative_tokens=4, class_acceptance=a) for a in (0.9, 0.3))
    st = route_state(costs=costs(0.25))
    assert st.overlaps(1, 4, req(high))  # D = V = 1 s
    assert not route_state(costs=costs(0.5)).overlaps(1, 4, req(low))
    # the request's own evidence outweighs its class: 400 judged draft tokens, 120 accepted
    costly = route_state(costs=costs(0.3))
    assert costly.overlaps(1, 4, req(high))
    assert not costly.overlaps(1, 4, req(high, 120, [100, 100, 100, 100]))
    assert not route_state(costs=costs(0.25), separate_overlap="never").overlaps(1, 4, req(high))
    assert route_state(costs=costs(0.5), separate_overlap="always").overlaps(1, 4, req(low))

    adaptive_k = st.separate_adaptive(AcceptanceTracker(prior_mean=0.9))
    cls = adaptive_k.traffic_class(0.0, "default")
    state = adaptive_k.choose(None, cls, 0, 0, 1, 8, context_len=64, class_estimate=0.9)
    want = CostModel(st.costs).best_k(1, 0.9, 8, "separate", allow_plain=False).k
    assert state.k == want and 1 <= want < 8 and adaptive_k.topology == "separate"
    st.set_costs(costs(0.05), "recalibrated")  # a cheaper draft: the loop's adaptive K prices with it
    assert adaptive_k.view is st.view and adaptive_k.view.drift is st.drift
    assert adaptive_k.choose(None, cls, 0, 0, 1, 8, context_len=64, class_estimate=0.9).k >= want


def test_pools_on_shared_cores_are_priced_at_the_whole_load():
    """Six rows decoding plain: a request that would join the idle co-located pool runs at batch 1 on
    cores of its own, and at the whole load's batch where the pools share their cores (it takes its
    time from the plain rows'); there it goes plain, and the regime says the batch decided."""
    busy = {"plain": PoolLoad(active=6), "colocated": PoolLoad()}
    own = route(busy, state=route_state(costs=synthetic_costs()))
    shared = route_state(costs=synthetic_costs(), shared_compute=True)
    whole = route(busy, state=shared)
    assert own.pool == "colocated" and own.batch == 1, own.decision
    assert whole.pool == "plain" and whole.decision.regime == "large_batch" and "batch 7" in whole.decision.reason
    assert route({"plain": PoolLoad(), "colocated": PoolLoad()}, state=shared).pool == "colocated"  # idle: batch 1
    live = regimes_map(shared, busy)
    assert live["pools"]["colocated"]["beside"] == 6 and live["shared_compute"]


def test_the_config_says_when_pools_share_their_compute():
    """Null: shared where the engine processes' threads outnumber the CPUs (the default config's four
    single-threaded engines on 2 cores, not on 8), or where target-bearing pools take a fraction of a GPU."""
    from deployments.config import AppConfig

    default = AppConfig(target="t", draft="d", plain={"num_replicas": 1}, colocated={"num_replicas": 1},
                        draft_deployment={"num_replicas": 1}, target_deployment={"num_replicas": 1})
    assert default.pools_share_compute_on(2) and not default.pools_share_compute_on(8)
    assert default.model_copy(update={"torch_threads": 2}).pools_share_compute_on(4)
    gpu = {"num_replicas": 1, "num_gpus": 1}
    assert not default.model_copy(update={"plain": default.plain.model_copy(update=gpu),
                                          "colocated": default.colocated.model_copy(update=gpu),
                                          "target_deployment": default.target_deployment.model_copy(
                                              update=gpu)}).pools_share_compute_on(2)
    half = default.model_copy(update={"plain": default.plain.model_copy(update={"num_gpus": 0.5})})
    assert half.pools_share_compute_on(64)
    assert not default.model_copy(update={"pools_share_compute": False}).pools_share_compute_on(2)
