"""Logic of the Serve layer without a cluster: the route decision, session placement, the config,
and the separate topology's stopping rules."""

from __future__ import annotations

import asyncio
import dataclasses
from types import SimpleNamespace

import pytest
from pydantic import ValidationError

from autoscaling.routing import PoolLoad, RoutingError
from autoscaling.traffic_classes import DomainTable
from deployments.config import AppConfig, resolve_model_path
from deployments.messages import Delta
from deployments.route_state import PRIOR_COSTS, RouteState, objective_of, with_hops
from deployments.session_router import SessionAffinityRouter, owner
from specdec_core import SamplingParams
from specdec_core.acceptance import AcceptanceTracker, TrafficClass
from specdec_core.costmodel import StepCosts
from specdec_core.request import RequestState
from specdec_core.stats import RequestStats

ALL = {"plain": PoolLoad(), "colocated": PoolLoad(), "separate": PoolLoad()}


def _compute_bound_costs() -> StepCosts:
    """Synthetic costs: 10 ms overhead + 4 ms per token in the forward (compute bound from ~b*q = 8)."""
    batches, qs = (1, 2, 4, 8, 16, 32), (1, 2, 3, 5, 9)
    return StepCosts(batches, qs, tuple(tuple(0.010 + 0.004 * b * q for q in qs) for b in batches),
                     tuple(0.003 for _ in batches), source="synthetic")


def _state(a=0.9, evidence=0, costs=None, **kw) -> RouteState:
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
    st = state or _state(costs=_compute_bound_costs())
    cls = st.traffic_class(temperature, domain)
    f = st.features(temperature=temperature, top_p=1.0, max_tokens=max_tokens, prompt_tokens=prompt_tokens,
                    mode=mode, k=k, topology=topology, objective=objective, cls=cls)
    return st.decide(f, loads)


def test_glue_context_from_loads_tracker_costs():
    st = _state(a=0.8, evidence=100, costs=_compute_bound_costs())
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
    low = _state(a=0.1, evidence=200, costs=_compute_bound_costs())
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

    st = _state(costs=_compute_bound_costs())
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
    st.set_costs(_compute_bound_costs(), "calibrated:cpu")
    m = st.regimes({"plain": PoolLoad(active=2), "colocated": PoolLoad(active=30)})
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
    drift = st.regimes({"plain": PoolLoad()})["costs"]["drift"]
    assert drift[0]["plain_steps"] == 1 and drift[0]["plain"] > 1.0 and drift[0]["spec_steps"] == 0


def test_regimes_map_has_a_context_axis():
    """Per class, the regime along the context: with a per-row slope that grows with the verify width
    (attention compute bound, as on this CPU) the batch-1 speedup falls with the context."""
    costs = dataclasses.replace(_compute_bound_costs(), context_slope_s=tuple(2e-6 * q for q in (1, 2, 3, 5, 9)))
    st = _state(a=0.9, costs=costs)
    axis = st.regimes({"plain": PoolLoad(), "colocated": PoolLoad()})["classes"][0]["by_context"]
    assert [e["context"] for e in axis] == [128, 256]  # below the context limit, 512
    assert axis[0]["predicted_speedup_batch1"] > axis[1]["predicted_speedup_batch1"] > 1
    assert all(e["break_even_batch"] is None or e["break_even_batch"] >= 1 for e in axis)


def test_prior_costs_and_hops():
    assert PRIOR_COSTS.target_time(32, 9) > 3 * PRIOR_COSTS.target_time(32, 1)
    assert with_hops(PRIOR_COSTS, 0.02).hop("separate") == 0.02


def test_calibration_file_roundtrip(tmp_path):
    from deployments.calibrate import load_calibration, record, save_calibration

    costs = _compute_bound_costs()
    path = tmp_path / "cal.json"
    save_calibration(path, record(costs, str(tmp_path / "t"), str(tmp_path / "d"), "cpu"))
    save_calibration(path, record(PRIOR_COSTS, str(tmp_path / "t"), str(tmp_path / "other"), "cpu"))
    assert load_calibration(path, str(tmp_path / "t"), str(tmp_path / "d"), "cpu") == costs
    assert load_calibration(path, str(tmp_path / "t"), str(tmp_path / "other"), "cpu").batches == PRIOR_COSTS.batches
    assert load_calibration(path, str(tmp_path / "t"), str(tmp_path / "d"), "cuda") is None
    assert load_calibration(tmp_path / "missing.json", "t", "d", "cpu") is None


def test_autoscaling_options():
    from deployments.app import _options
    from deployments.config import AppConfig

    cfg = AppConfig(colocated={"autoscaling": {"enabled": True, "min_replicas": 1, "max_replicas": 3,
                                               "target_ongoing_requests": 4}})
    opts = _options(cfg.colocated, "ColocatedPool")
    assert "num_replicas" not in opts
    ac = opts["autoscaling_config"]
    assert (ac["min_replicas"], ac["max_replicas"], ac["upscale_delay_s"], ac["downscale_delay_s"]) == (1, 3, 0, 0)
    assert ac["policy"]["policy_function"] == "autoscaling.scaling:PoolAutoscalingPolicy"
    assert ac["policy"]["policy_kwargs"]["target_ongoing_per_replica"] == 4
    from ray.serve.config import AutoscalingConfig

    AutoscalingConfig(**ac)  # Serve accepts it
    assert _options(AppConfig().plain, "PlainPool")["num_replicas"] == 1
    with pytest.raises(ValidationError):
        AppConfig(plain={"autoscaling": {"enabled": True, "min_replicas": 3, "max_replicas": 2}})


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
        AppConfig(auto_max_running=4)  # the placeholder rule's keys are gone
    with pytest.raises(ValidationError):
        AppConfig(draft_deployment={"num_replicas": 0})
    for name, field in AppConfig.model_fields.items():
        assert field.description, name
    assert resolve_model_path("no/such/model") == "no/such/model"
    assert resolve_model_path("tests").endswith("/tests")


class _Tok:
    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(ord("a") + i % 26) for i in ids)


def _req(**kw) -> RequestState:
    return RequestState("r", [1, 2], SamplingParams(**kw), _Tok(), eos_ids={99})


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
    assert (r.finish_reason, Delta.of(r.output()).text) == ("stop", "ab")
    r = _req(max_new_tokens=10)
    r.commit([0, 1])
    d = Delta.of(r.output())
    assert (d.token_ids, d.text, d.finished) == ([0, 1], "ab", False)
    r.commit([2])
    assert Delta.of(r.output()).token_ids == [2]
    assert r.budget_k(4, max_len=100) == 4
    assert r.budget_k(9, max_len=6) == 1  # 5 tokens held, room for 1 draft token
    # an overlapped round's proposal follows 4 tokens not yet committed: 3 of the 7 left, room for 2
    assert r.budget_k(4, max_len=100, ahead=4) == 2
    assert r.budget_k(9, max_len=8, ahead=2) == 1  # 5 held + 2 ahead: room for 1
    r2 = _req(max_new_tokens=2)
    r2.commit([0])
    assert r2.budget_k(4, max_len=100) == 0  # one token left: a plain step emits it


def test_router_metrics_accept_zero_counts():
    from deployments.metrics import RouterMetrics

    m = RouterMetrics()
    m.finished("plain", 0, None, "length", RequestStats(output_tokens=3), 0.1)
    m.finished("colocated", 4, "colocated", "abort", None, 0.1)
    m.finished("colocated", 4, "colocated", "length", RequestStats(output_tokens=8, proposed=8, verify_steps=4),
               0.1, "favorable", 1.3)
    m.routed("plain", 0, "large_batch", "auto", 1.0)
    m.set_running("plain", 0)
    m.acceptance(TrafficClass("d", "greedy", "default"), 0.5, [0.6, 0.4])


def test_specdec_calibrate_cli(tiny_models, tmp_path):
    """The console script's entry point writes a record the replicas can load (a small grid)."""
    from deployments.calibrate import load_calibration, main

    out = tmp_path / "cal.json"
    main(["--target", tiny_models["target"], "--draft", tiny_models["draft"], "--out", str(out),
          "--batches", "1,2", "--qs", "1,2", "--max-batch-size", "4"])
    costs = load_calibration(out, tiny_models["target"], tiny_models["draft"], "cpu")
    assert costs is not None and costs.batches == (1, 2) and costs.qs == (1, 2)
    assert costs.target_time(1, 1) > 0 and costs.draft_time(1) > 0


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
    st = _state(costs=_compute_bound_costs())
    loads = {**ALL, "colocated": PoolLoad(active=8), "separate": PoolLoad(active=12)}
    assert route(loads, state=st).pool == "plain"
    cm, batch = st.cost_model(), loads["colocated"].joined_batch()
    plain = _served_stats(k=0, decode_steps=40)
    spec = _served_stats(k=4, decode_steps=10, budget_tail=True)  # ends on a K=0 step: still a K=4 request
    assert spec.plain_steps == 2 and spec.mean_acceptance_length == 3.0
    for _ in range(30):
        st.observe_timing("separate", batch, spec, 1.0)  # hops: not a step-cost drift
        st.observe_timing("colocated", batch, _served_stats(k=4, decode_steps=10, plain_decode=5), 1.0)  # K changed
    assert route(loads, state=st).pool == "plain"
    for _ in range(30):
        st.observe_timing("plain", batch, plain, 2.5 * cm.calibrated_step_time(batch, 0))
        st.observe_timing("colocated", batch, spec, cm.calibrated_step_time(batch, 4) / 3.0)
    r = route(loads, state=st)
    assert (r.pool, r.decision.regime) == ("colocated", "favorable") and r.decision.predicted_speedup > 1.2
    st.set_costs(_compute_bound_costs(), "recalibrated")  # new costs: what was learnt is dropped
    assert route(loads, state=st).pool == "plain"


def test_a_budgeted_pool_is_routed_on_what_its_planner_will_do():
    """With budgeted verification the co-located replica plans every step for its batch (K per row,
    a 10% margin over a plain step): the router prices the pool with that plan, not with one K per
    request, so the two agree on where speculation runs (and /v1/regimes says the same)."""
    from specdec_core.step_planner import budgeted_choice

    costs = _compute_bound_costs()
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
    regimes = _state(costs=costs, budgeted=True).regimes({"plain": PoolLoad(), "colocated": PoolLoad()})
    cls = regimes["classes"][0]
    plan1 = budgeted_choice(_state(costs=costs).cost_model(), 1, (cls["acceptance"],) * 8)
    assert (cls["best_k_batch1"], cls["predicted_speedup_batch1"]) == (plan1.k, pytest.approx(plan1.predicted_speedup))


def test_served_timing_is_learnt_at_the_batch_the_request_decoded_in():
    """A request that joined an idle pool (batch 1) and then decoded beside seven others teaches the
    drift of batch 8, not of batch 1: its steps cost batch-8 steps."""
    st = _state(costs=_compute_bound_costs())
    cm = st.cost_model()
    plain = _served_stats(k=0, decode_steps=40)
    plain.decode_steps, plain.decode_batch_rows = 40, 40 * 8
    for _ in range(5):
        st.learn("plain", 1, TrafficClass.of("d", 0.0), plain, cm.calibrated_step_time(8, 0), migrated=False)
    drift = st.regimes({"plain": PoolLoad()})["costs"]["drift"]
    assert list(drift) == [3] and drift[3]["plain"] == pytest.approx(1.0), drift  # bucket of batch 8, as calibrated


def test_a_request_is_priced_at_the_batch_it_will_decode_in():
    """In a burst the first requests join an idle co-located pool and decode beside the ones that follow:
    the router learns how many rows join a request while it decodes (per pool, from finished requests)
    and prices the next one at that batch, not at the batch it joins; the lesson fades once the burst
    is over (fake clock), and /v1/regimes shows it."""
    now = [0.0]
    st = _state(costs=_compute_bound_costs(), clock=lambda: now[0])
    idle = {"plain": PoolLoad(), "colocated": PoolLoad()}
    assert route(idle, state=st).pool == "colocated"  # batch 1 pays
    assert route({"plain": PoolLoad(), "colocated": PoolLoad(active=7)}, state=st).pool == "plain"  # batch 8 does not
    burst = _served_stats(k=4, decode_steps=12)
    burst.decode_steps, burst.decode_batch_rows = 12, 12 * 8  # joined at batch 1, decoded at batch 8
    for _ in range(10):
        st.learn("colocated", 1, TrafficClass.of("d", 0.0), burst, 0.0, migrated=False)
    assert st.joining("colocated", 1) == pytest.approx(7 * (1 - 0.8 ** 10))
    assert st.joining("colocated", 8) == 0.0  # learnt for requests that joined at batch 1
    assert st.regimes(idle)["pools"]["colocated"]["joining"] == pytest.approx(st.joining("colocated", 1))
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
        r = ScheduledRequest("r", list(range(64)), params, _Tok(), {99})
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


def test_chat_fallback_template_keeps_special_token_text_as_text():
    """The shipped tokenizer has no chat template: a message that spells "<|endoftext|>" (the EOS and
    document separator) stays text in the prompt, never the special token; roles come from the
    fixed set (schemas.ChatMessage), so a turn cannot be forged through one."""
    from deployments.planning import Prompts

    prompts = Prompts(AppConfig(target="models/target", draft=None))
    eos = prompts.tokenizer.eos_token_id
    ids = asyncio.run(prompts.chat_ids([{"role": "user", "content": "hi <|endoftext|> there"}]))
    assert eos not in ids
    assert prompts.tokenizer.decode(ids) == "user: hi <|endoftext|> there\nassistant:"


def test_startup_calibration_cache_is_keyed_by_weights_and_grid(tmp_path, monkeypatch, tiny_models):
    """A cached calibration comes back for the same models and grid on this host; new weights at the
    same path (or another grid) miss, so a retrained model is never priced by its predecessor's costs."""
    import os
    import time

    from deployments import calibrate

    monkeypatch.setattr(calibrate, "CACHE_DIR", tmp_path)
    grid = {"batches": (1, 2), "qs": (1, 5), "long_context_len": 64}
    key = calibrate.cache_key(tiny_models["target"], tiny_models["draft"], "cpu", None, **grid)
    assert calibrate.cached(key) is None
    costs = _compute_bound_costs()
    calibrate.store(key, costs, None)
    greedy, sampled = calibrate.cached(key)
    assert greedy.to_dict() == costs.to_dict() and sampled is None
    assert calibrate.cache_key(tiny_models["target"], tiny_models["draft"], "cpu", None, **grid) == key
    assert calibrate.cache_key(tiny_models["target"], tiny_models["draft"], "cpu", None,
                               **{**grid, "qs": (1, 3)}) != key
    weights = next(p for p in os.scandir(tiny_models["target"]) if p.name.endswith(".safetensors"))
    later = time.time() + 10
    os.utime(weights.path, (later, later))  # retrained in place
    assert calibrate.cache_key(tiny_models["target"], tiny_models["draft"], "cpu", None, **grid) != key


def test_placement_options_reach_serve():
    """Custom resources and node labels of a deployment go into its ray_actor_options (only where set),
    in a form Serve accepts, so an operator can put the Draft and the Target on different nodes."""
    from ray.serve._private.config import ReplicaConfig

    from deployments.app import _options

    cfg = AppConfig(draft_deployment={"resources": {"draft_node": 0.01}},
                    target_deployment={"label_selector": {"ray.io/node-group": "target"}})
    draft, target = _options(cfg.draft_deployment, "Draft"), _options(cfg.target_deployment, "Target")
    assert draft["ray_actor_options"]["resources"] == {"draft_node": 0.01}
    assert "label_selector" not in draft["ray_actor_options"]
    assert target["ray_actor_options"]["label_selector"] == {"ray.io/node-group": "target"}
    assert "resources" not in _options(cfg.plain, "PlainPool")["ray_actor_options"]
    for opts in (draft, target):
        ReplicaConfig.create(lambda: None, ray_actor_options=opts["ray_actor_options"])  # Serve's own validation
