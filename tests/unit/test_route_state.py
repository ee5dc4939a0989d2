"""The router's state without a cluster (``deployments/route_state.py``): the context it builds for
``route()`` from the pools' loads, the acceptance tracker and the costs; explicit fields and fallbacks;
the regime map of ``/v1/regimes``; and what it learns from finished requests (served drift, the batch a
request decodes in) and how that moves routing, the budgeted pool and the separate topology's choices."""

from __future__ import annotations

import dataclasses

import pytest
from served import CharTokenizer, synthetic_costs

from autoscaling.routing import PoolLoad, RoutingError
from autoscaling.traffic_classes import DomainTable
from deployments.messages import Progress
from deployments.regimes_map import regimes_map
from deployments.route_state import PRIOR_COSTS, RouteState, objective_of, with_hops
from specdec_core import SamplingParams
from specdec_core.acceptance import AcceptanceTracker, TrafficClass
from specdec_core.costmodel import StepCosts
from specdec_core.stats import RequestStats

ALL = {"plain": PoolLoad(), "colocated": PoolLoad(), "separate": PoolLoad()}


def _state(a=0.9, evidence=0, costs=None, **kw) -> RouteState:
    kw.setdefault("clock", lambda: 0.0)  # a frozen clock: no lesson fades between two lines of a test
    tr = AcceptanceTracker(prior_mean=a)
    st = RouteState("d", tr, k_max=8, default_k=4, context_limit=512, domains=DomainTable(promote_after=1), **kw)
    if costs is not None:
        st.set_costs(costs, "test")
    if evidence:
        cls = TrafficClass.of("d", 0.0)
        tr.observe_request(cls, [evidence], [round(a * evidence)])
    return st


def route(loads=ALL, state=None, mode="auto", k=None, topology=None, temperature=0.0, objective="latency",
          max_tokens=64, prompt_tokens=8, domain=None):
    st = state or _state(costs=synthetic_costs())
    cls = st.traffic_class(temperature, domain)
    f = st.features(temperature=temperature, top_p=1.0, max_tokens=max_tokens, prompt_tokens=prompt_tokens,
                    mode=mode, k=k, topology=topology, objective=objective, cls=cls)
    return st.decide(f, loads)


def test_glue_context_from_loads_tracker_costs():
    st = _state(a=0.8, evidence=100, costs=synthetic_costs())
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
    low = _state(a=0.1, evidence=200, costs=synthetic_costs())
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

    st = _state(costs=synthetic_costs())
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
    st = _state(a=0.6)
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
    st = _state(a=0.9, costs=costs)
    axis = regimes_map(st, {"plain": PoolLoad(), "colocated": PoolLoad()})["classes"][0]["by_context"]
    assert [e["context"] for e in axis] == [128, 256]  # below the context limit, 512
    assert axis[0]["predicted_speedup_batch1"] > axis[1]["predicted_speedup_batch1"] > 1
    assert all(e["break_even_batch"] is None or e["break_even_batch"] >= 1 for e in axis)


def test_prior_costs_and_hops():
    assert PRIOR_COSTS.target_time(32, 9) > 3 * PRIOR_COSTS.target_time(32, 1)
    assert with_hops(PRIOR_COSTS, 0.02).hop("separate") == 0.02


def _served_stats(k: int, decode_steps: int, budget_tail: bool = False, plain_decode: int = 0) -> RequestStats:
    """A finished request's stats as the engine records them: the prefill's pass counts as a plain
    step; K=k decode steps accepting 2 of k each; optional K=0 decode steps."""
    stats = RequestStats()
    stats.record_verify(0, 0)  # the prefill
    for _ in range(decode_steps):
        stats.record_verify(k, min(2, k))
    for _ in range(plain_decode + budget_tail):
        stats.record_verify(0, 0)
    return stats


def test_served_step_times_correct_the_routing():
    """At batch 9 the engine-step costs send auto traffic to the plain pool. Served plain requests
    then measure 2.5x their calibrated step (the serving loop's per-step cost; more than an engine's
    own drift bounds believe) while co-located speculative steps match theirs: the router learns it
    and routes speculation there too."""
    st = _state(costs=synthetic_costs())
    loads = {**ALL, "colocated": PoolLoad(active=8), "separate": PoolLoad(active=12)}
    assert route(loads, state=st).pool == "plain"
    cm, batch = st.cost_model(), loads["colocated"].joined_batch()
    plain = _served_stats(k=0, decode_steps=40)
    spec = _served_stats(k=4, decode_steps=10, budget_tail=True)  # ends on a K=0 step: still a K=4 request
    assert spec.plain_steps == 2 and spec.mean_acceptance_length == 3.0
    for _ in range(30):
        st.observe_timing("separate", batch, spec, 1.0)  # hops: not a step-cost drift
    assert route(loads, state=st).pool == "plain"
    for _ in range(30):
        st.observe_timing("plain", batch, plain, 2.5 * cm.calibrated_step_time(batch, 0))
        st.observe_timing("colocated", batch, spec, cm.calibrated_step_time(batch, 4) / 3.0)
    r = route(loads, state=st)
    assert (r.pool, r.decision.regime) == ("colocated", "favorable") and r.decision.predicted_speedup > 1.2
    st.set_costs(synthetic_costs(), "recalibrated")  # new costs: what was learnt is dropped
    assert route(loads, state=st).pool == "plain"


def test_auto_requests_that_adaptive_k_moved_between_k_teach_the_served_drift():
    """Served auto requests in the co-located pool ran most of their steps plain (adaptive K went to
    K=0) and their K=3 steps took 1.6x their calibrated time: the router learns that from their steps of
    each K, the plain ones priced with plain's measured factor, and stops sending the class there."""
    st = _state(costs=synthetic_costs())
    idle = {"plain": PoolLoad(), "colocated": PoolLoad()}
    first = route(idle, state=st)
    assert (first.pool, first.decision.k) == ("colocated", 3) and first.decision.predicted_speedup > 1.3
    cm = st.cost_model()
    mixed = _served_stats(k=3, decode_steps=10, plain_decode=30)  # 10 K=3 steps accepting 2 each, 30 plain
    measured = 30 * 1.1 * cm.calibrated_step_time(1, 0) + 10 * 1.1 * 1.6 * cm.calibrated_step_time(1, 3)
    for _ in range(30):
        st.observe_timing("plain", 1, _served_stats(k=0, decode_steps=40), 1.1 * cm.calibrated_step_time(1, 0))
        st.observe_timing("colocated", 1, mixed, measured / (30 + 10 + 20))
    drift = regimes_map(st, idle)["costs"]["drift"][0]
    assert drift["spec_steps"] == 30 and drift["spec"] == pytest.approx(1.6)
    after = route(idle, state=st)
    assert after.pool == "plain", after.decision


def test_a_pool_whose_adaptive_k_ran_a_class_plain_is_not_sent_more_of_it_until_the_lesson_fades():
    """The router prices K=3 in the co-located pool at 1.38x, but that pool's adaptive K ran 88% of the
    steps of the greedy auto requests sent there plain (its measured speculative steps lost to its plain
    ones): the class goes to the plain pool, saying why, while another class and fixed-K requests still
    go there; two minutes later the lesson has faded and the class is offered speculation again."""
    now = [0.0]
    st = _state(costs=synthetic_costs(), clock=lambda: now[0])
    idle = {"plain": PoolLoad(), "colocated": PoolLoad()}
    assert route(idle, state=st).pool == "colocated"
    declined = _served_stats(k=3, decode_steps=4, plain_decode=30)
    for _ in range(5):
        st.learn_declined("colocated", 1, TrafficClass.of("d", 0.0), Progress.of(declined))
    assert st.declined("colocated", 1, TrafficClass.of("d", 0.0)) == pytest.approx(0.88 * (1 - 0.8 ** 5), abs=0.01)
    r = route(idle, state=st)
    assert r.pool == "plain" and "adaptive K ran such requests plain" in r.decision.reason, r.decision
    (lesson,) = regimes_map(st, idle)["declined"]
    assert (lesson["pool"], lesson["batch_bucket"], lesson["class"]["temperature_bucket"]) == ("colocated", 0, "greedy")
    assert route(idle, state=st, temperature=1.0).pool == "colocated"
    assert route(idle, state=st, mode="speculative").pool == "colocated"
    now[0] += 120.0
    assert route(idle, state=st).pool == "colocated"


def test_a_decline_is_learnt_window_by_window_each_worth_its_share_of_a_window():
    """Requests teach what their pool's adaptive K ran plain as they decode, a window of their decode steps at
    a time (their deltas' progress), not once they finish: four windows in which 14 of 16 steps ran plain
    send the class plain. A request's last, shorter window moves the lesson by its share of a window."""
    cls, idle = TrafficClass.of("d", 0.0), {"plain": PoolLoad(), "colocated": PoolLoad()}
    st = _state(costs=synthetic_costs())
    window = Progress(plain_steps=14, verify_steps=2, batch_rows=16)
    for n in range(1, 5):
        assert route(idle, state=st).pool == "colocated"
        st.learn_declined("colocated", 1, cls, window)
        assert st.declined("colocated", 1, cls) == pytest.approx(14 / 16 * (1 - 0.8 ** n))
    assert route(idle, state=st).pool == "plain"
    other = TrafficClass.of("d", 1.0)
    st.learn_declined("colocated", 1, other, Progress(plain_steps=4, verify_steps=0, batch_rows=4))
    assert st.declined("colocated", 1, other) == pytest.approx(0.2 * 4 / 16)
    st.learn_declined("colocated", 1, other, Progress())  # no decode step: nothing learnt
    assert st.declined("colocated", 1, other) == pytest.approx(0.2 * 4 / 16)


def test_on_shared_cores_a_pools_decline_stands_for_the_other_and_co_located_binds_separate():
    """The co-located pool's adaptive K ran the class plain. On cores of their own, the separate pool is
    still offered (its draft runs elsewhere); on shared cores the same drafts and verifies would run on
    the same cores, so the class goes plain, even once the separate pool has a lesson of its own."""
    cls = TrafficClass.of("d", 0.0)
    pools = {"plain": PoolLoad(), "colocated": PoolLoad(), "separate": PoolLoad()}
    declined = _served_stats(k=3, decode_steps=4, plain_decode=30)
    for shared in (False, True):
        st = _state(costs=synthetic_costs(), shared_compute=shared)
        for _ in range(5):
            st.learn_declined("colocated", 1, cls, Progress.of(declined))
        r = route(pools, state=st)
        if not shared:
            assert r.pool == "separate", r.decision
            continue
        assert r.pool == "plain" and st.declined("separate", 1, cls) == st.declined("colocated", 1, cls), r.decision
        assert route(pools, state=st, temperature=1.0).pool != "plain"  # another class: no lesson
        for _ in range(5):  # a lesson of its own, that its adaptive K kept speculating, does not lift it:
            st.learn_declined("separate", 1, cls, Progress.of(_served_stats(k=2, decode_steps=20)))
        assert route(pools, state=st).pool == "plain"  # its rounds are the co-located pool's forwards plus hops
        other = TrafficClass.of("d", 1.0)
        for _ in range(5):  # the other way round, the separate pool's verdict stands only while co-located has none
            st.learn_declined("separate", 1, other, Progress.of(declined))
        assert st.declined("colocated", 1, other) == st.declined("separate", 1, other) >= 0.5
        for _ in range(5):
            st.learn_declined("colocated", 1, other, Progress.of(_served_stats(k=2, decode_steps=20)))
        assert st.declined("colocated", 1, other) < 0.5 <= st.declined("separate", 1, other)
        assert route(pools, state=st, temperature=1.0).pool == "colocated"


def test_a_budgeted_pool_is_routed_on_what_its_planner_will_do():
    """With budgeted verification the co-located replica plans every step for its batch (K per row,
    a 10% margin over a plain step): the router prices the pool with that plan, not with one K per
    request, so the two agree on where speculation runs (and /v1/regimes says the same)."""
    from specdec_core.step_planner import budgeted_choice

    costs = synthetic_costs()
    differ = 0
    for active in range(0, 12):
        loads = {"plain": PoolLoad(), "colocated": PoolLoad(active=active)}
        per_request = route(loads, state=_state(costs=costs))
        budgeted = route(loads, state=_state(costs=costs, budgeted=True))
        plan = budgeted_choice(_state(costs=costs).cost_model(), active + 1, (0.9,) * 8)
        assert (budgeted.pool == "colocated") == (plan.k > 0), (active, budgeted.decision)
        if budgeted.pool == "colocated":
            assert budgeted.decision.k == plan.k
            assert budgeted.decision.predicted_speedup == pytest.approx(plan.predicted_speedup)
        differ += (per_request.pool, per_request.decision.k) != (budgeted.pool, budgeted.decision.k)
    assert differ  # the plan's pricing is not one K per request's
    regimes = regimes_map(_state(costs=costs, budgeted=True), {"plain": PoolLoad(), "colocated": PoolLoad()})
    cls = regimes["classes"][0]
    plan1 = budgeted_choice(_state(costs=costs).cost_model(), 1, (cls["acceptance"],) * 8)
    assert (cls["best_k_batch1"], cls["predicted_speedup_batch1"]) == (plan1.k, pytest.approx(plan1.predicted_speedup))


def test_served_timing_is_learnt_at_the_batch_the_request_decoded_in():
    """A request that joined an idle pool (batch 1) and then decoded beside seven others teaches the
    drift of batch 8, not of batch 1: its steps cost batch-8 steps."""
    st = _state(costs=synthetic_costs())
    cm = st.cost_model()
    plain = _served_stats(k=0, decode_steps=40)
    plain.decode_steps, plain.decode_batch_rows = 40, 40 * 8
    for _ in range(5):
        st.learn("plain", 1, TrafficClass.of("d", 0.0), plain, cm.calibrated_step_time(8, 0), migrated=False)
    drift = regimes_map(st, {"plain": PoolLoad()})["costs"]["drift"]
    assert list(drift) == [3] and drift[3]["plain"] == pytest.approx(1.0), drift  # bucket of batch 8, as calibrated


def test_a_request_is_priced_at_the_batch_it_will_decode_in():
    """In a burst the first requests join an idle co-located pool and decode beside the ones that follow:
    the router learns how many rows join a request while it decodes (per pool, from finished requests)
    and prices the next one at that batch, not at the batch it joins; the lesson fades once the burst
    is over (fake clock), and /v1/regimes shows it."""
    now = [0.0]
    st = _state(costs=synthetic_costs(), clock=lambda: now[0])
    idle = {"plain": PoolLoad(), "colocated": PoolLoad()}
    assert route(idle, state=st).pool == "colocated"  # batch 1 pays
    assert route({"plain": PoolLoad(), "colocated": PoolLoad(active=7)}, state=st).pool == "plain"  # batch 8 does not
    burst = _served_stats(k=4, decode_steps=12)
    burst.decode_steps, burst.decode_batch_rows = 12, 12 * 8  # joined at batch 1, decoded at batch 8
    for _ in range(10):
        st.learn("colocated", 1, TrafficClass.of("d", 0.0), burst, 0.0, migrated=False)
    assert st.joining("colocated", 1) == pytest.approx(7 * (1 - 0.8 ** 10))
    assert st.joining("colocated", 8) == 0.0  # learnt for requests that joined at batch 1
    assert regimes_map(st, idle)["pools"]["colocated"]["joining"] == pytest.approx(st.joining("colocated", 1))
    r = route(idle, state=st)
    assert r.pool == "plain" and "batch 7" in r.decision.reason, r.decision  # priced where it would decode
    now[0] += 120.0  # four half-lives without a finished request: back to the batch it joins
    assert st.joining("colocated", 1) < 0.5 and route(idle, state=st).pool == "colocated"


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
    st = _state(costs=costs(0.25))
    assert st.overlaps(1, 4, req(high))  # D = V = 1 s
    assert not _state(costs=costs(0.5)).overlaps(1, 4, req(low))
    # the request's own evidence outweighs its class: 400 judged draft tokens, 120 accepted
    costly = _state(costs=costs(0.3))
    assert costly.overlaps(1, 4, req(high))
    assert not costly.overlaps(1, 4, req(high, 120, [100, 100, 100, 100]))
    assert not _state(costs=costs(0.25), separate_overlap="never").overlaps(1, 4, req(high))
    assert _state(costs=costs(0.5), separate_overlap="always").overlaps(1, 4, req(low))

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
    own = route(busy, state=_state(costs=synthetic_costs()))
    shared = _state(costs=synthetic_costs(), shared_compute=True)
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


def test_on_shared_cores_the_rows_that_join_a_request_are_the_whole_loads():
    """A burst on shared cores: a request joined an idle system and ran beside seven rows of any pool
    (``whole_load``: per-replica rows when it joined, and their mean while it ran). The router learns
    that the next request to join an idle system decodes at batch 8, where speculation does not pay;
    its own pool's batch (1, alone in the co-located pool) does not teach it, and every pool learns it
    (no pool looks emptier than another for where its requests happened to join)."""
    st = _state(costs=synthetic_costs(), shared_compute=True)
    idle = {"plain": PoolLoad(), "colocated": PoolLoad()}
    assert route(idle, state=st).pool == "colocated"
    alone = _served_stats(k=4, decode_steps=12)
    alone.decode_steps, alone.decode_batch_rows = 12, 12  # its own pool: batch 1 throughout
    for _ in range(10):
        st.learn("colocated", 1, TrafficClass.of("d", 0.0), alone, 0.0, migrated=False, whole_load=(1, 8.0))
    assert st.joining("colocated", 1) == pytest.approx(7 * (1 - 0.8 ** 10))
    assert st.joining("separate", 1) == pytest.approx(st.joining("colocated", 1))  # the whole load: every pool
    r = route(idle, state=st)
    assert r.pool == "plain" and r.decision.regime == "large_batch", r.decision


def test_on_shared_cores_a_request_beside_another_pools_rows_teaches_no_drift():
    """A plain request that decoded at batch 6 while the whole load averaged 8 rows (two in the
    co-located pool, on the same cores) measured their contention, not its step: where pools share
    their cores it teaches no drift; one that had the cores to itself does, and on cores of their own
    both do."""
    def plain_at(batch: int) -> RequestStats:
        stats = _served_stats(k=0, decode_steps=40)
        stats.decode_steps, stats.decode_batch_rows = 40, 40 * batch
        return stats

    for shared, beside, learnt in ((True, True, False), (True, False, True), (False, True, True)):
        st = _state(costs=synthetic_costs(), shared_compute=shared)
        slow = 1.5 * st.cost_model().calibrated_step_time(6, 0)
        for _ in range(5):
            st.learn("plain", 6, TrafficClass.of("d", 0.0), plain_at(6), slow, migrated=False,
                     whole_load=(6, 8.0 if beside else 6.0))
        drift = regimes_map(st, {"plain": PoolLoad()})["costs"]["drift"]
        assert (3 in drift) == learnt, (shared, beside, drift)
        if learnt:
            assert drift[3]["plain"] == pytest.approx(1.5) and drift[3]["plain_steps"] == 5
