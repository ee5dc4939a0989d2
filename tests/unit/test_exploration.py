"""Exploration under a fake clock: a traffic class that went plain for its acceptance keeps
probing speculation at a bounded rate, and returns to speculation when its acceptance recovers."""

from __future__ import annotations

import pytest

from autoscaling.exploration import Exploration
from autoscaling.probes import PROBE_K
from autoscaling.routing import PoolLoad
from autoscaling.traffic_classes import DomainTable
from deployments.route_state import RouteState
from specdec_core.acceptance import AcceptanceTracker, TrafficClass
from specdec_core.costmodel import CostModel
from specdec_core.stats import RequestStats
from specdec_core.step_costs import StepCosts

CLS = TrafficClass("d", "greedy", "code")
LOADS = {"plain": PoolLoad(), "colocated": PoolLoad()}


def test_schedule_bounds_probes_to_a_share_and_an_interval():
    ex = Exploration(share=0.1, min_interval_s=5.0)
    due = [ex.probe_due(CLS, now=float(i)) for i in range(100)]  # one plain-routed request a second
    assert sum(due) == 10 and not any(due[:9])
    fast = Exploration(share=0.1, min_interval_s=5.0)
    due = [fast.probe_due(CLS, now=i * 0.1) for i in range(100)]  # ten a second: the interval binds
    assert sum(due) == 2
    assert not any(Exploration(share=0.0).probe_due(CLS, float(i)) for i in range(100))
    other = TrafficClass("d", "greedy", "prose")
    ex.probe_due(other, 0.0)
    ex.forget_domain("prose")
    assert other not in ex._schedules and CLS in ex._schedules
    with pytest.raises(ValueError):
        Exploration(share=1.5)


def _costs() -> StepCosts:
    """Memory-bound synthetic costs: a verify of q tokens costs about one of 1; a draft of c = 0.3."""
    batches, qs = (1, 2, 4, 8), (1, 2, 3, 5, 9)
    return StepCosts(batches, qs, tuple(tuple(0.010 + 0.0002 * b * q for q in qs) for b in batches),
                     tuple(0.003 for _ in batches), source="synthetic")


def _state(now: list[float], shared_compute: bool = False) -> RouteState:
    tracker = AcceptanceTracker(prior_mean=0.8, prior_weight=20, half_life_s=60.0, clock=lambda: now[0])
    st = RouteState("d", tracker, k_max=8, default_k=4, context_limit=512, domains=DomainTable(promote_after=1),
                    exploration=Exploration(share=0.05, min_interval_s=1.0), clock=lambda: now[0],
                    shared_compute=shared_compute)
    st.set_costs(_costs(), "test")
    return st


def _request(st: RouteState, loads: dict[str, PoolLoad] = LOADS):
    features = st.features(temperature=0.0, top_p=1.0, max_tokens=64, prompt_tokens=16, mode="auto", k=None,
                           topology=None, objective="latency", cls=st.traffic_class(0.0, "code"))
    return st.decide(features, loads)


def _finished(k: int, steps: int, a: float) -> RequestStats:
    """A request's stats: `steps` verify steps at K=k, each accepting round(a * k) tokens."""
    stats = RequestStats()
    for _ in range(steps):
        stats.record_verify(k, round(a * k))
    return stats


def _finish(st: RouteState, r, a: float) -> None:
    """A probe finishes: `a` of its draft tokens accepted, its steps as calibrated."""
    stats = _finished(r.decision.k, 30, a)
    stats.prompt_tokens, stats.output_tokens = 16, 30
    st.learn(r.pool, r.batch, CLS, stats, st.cost_model().calibrated_step_time(1, r.decision.k)
             / stats.mean_acceptance_length, migrated=False)


def test_a_collapsed_class_returns_to_speculation_when_acceptance_recovers():
    now = [0.0]
    st = _state(now)
    assert _request(st).pool == "colocated"  # prior 0.8: speculation pays
    st.observe(CLS, _finished(4, 200, 0.0))  # the traffic turns: the draft is always wrong
    routes = []
    for _ in range(200):  # one request a second, the draft still wrong on every probe
        now[0] += 1.0
        r = _request(st)
        routes.append(r)
        if r.probe:
            _finish(st, r, 0.0)
    plain = [r for r in routes if not r.probe]
    probes = [r for r in routes if r.probe]
    cost = [r for r in probes if "cost probe" in r.decision.reason]
    assert all(r.pool == "plain" and r.decision.regime == "domain_mismatch" for r in plain)
    assert len(cost) == 3  # until three have measured served speculative steps at the batch
    assert 5 <= len(probes) - len(cost) <= 12, len(probes)  # ~5% of the class's requests
    assert all(r.pool == "colocated" and r.decision.k == PROBE_K and not r.adaptive for r in probes)
    assert all("exploration probe" in r.decision.reason for r in probes if r not in cost)
    for _ in range(400):  # the draft fits the traffic again: the probes show it
        now[0] += 1.0
        r = _request(st)
        if r.probe:
            _finish(st, r, 1.0)
        if not r.probe and r.pool == "colocated":
            break
    else:
        pytest.fail("the class never returned to speculation")
    assert r.decision.regime == "favorable" and r.adaptive


def test_no_probe_where_a_good_draft_would_not_pay():
    now = [0.0]
    st = _state(now)
    st.observe(CLS, _finished(4, 200, 0.0))
    features = st.features(temperature=0.0, top_p=1.0, max_tokens=4, prompt_tokens=16, mode="auto", k=None,
                           topology=None, objective="latency", cls=CLS)  # prefill heavy: 4 new tokens
    assert not any(st.decide(features, LOADS).probe for _ in range(100))


def test_cost_probes_measure_plain_steps_then_stop():
    """While served plain steps at a batch are unmeasured, every fifth auto request that would
    speculate runs plain instead; once a few plain requests have taught the drift, none does."""
    now = [0.0]
    st = _state(now)
    routes = [_request(st) for _ in range(20)]
    probes = [r for r in routes if r.probe]
    assert len(probes) == 4 and all(r.pool == "plain" and "cost probe" in r.decision.reason for r in probes)
    assert all(r.pool == "colocated" for r in routes if not r.probe)
    for _ in range(3):  # three finished plain requests at batch 1
        st.observe_timing("plain", 1, RequestStats(plain_steps=9, prompt_tokens=16, output_tokens=8),
                          st.cost_model().plain_time_per_token(1), CLS)
    assert not any(_request(st).probe for _ in range(20))


def test_on_shared_cores_cost_probes_run_only_where_they_would_decode_alone():
    """On shared cores a step beside another pool's rows teaches no drift, so a cost probe sent there
    would measure nothing and recur forever: with rows decoding in the co-located pool none runs plain;
    with the load in the plain pool itself (where a probe decodes alone) the probes run as before."""
    now = [0.0]
    st = _state(now, shared_compute=True)
    beside = {"plain": PoolLoad(), "colocated": PoolLoad(active=1)}
    assert not any(_request(st, beside).probe for _ in range(20))
    probes = [r for r in (_request(st) for _ in range(20)) if r.probe]
    assert len(probes) == 4 and all(r.pool == "plain" for r in probes)


def test_on_shared_cores_no_cost_probe_joins_an_idle_load_that_others_will_join():
    """A burst joins an idle load: its first request sees no rows beside it, but the router has learnt
    that seven more join such a request while it decodes; a probe sent elsewhere would decode beside them
    and teach nothing, so none runs, burst after burst; once the bursts are over, the probes run again."""
    now = [0.0]
    st = _state(now, shared_compute=True)
    for _ in range(10):
        st.learn("plain", 1, CLS, RequestStats(plain_steps=9), 0.0, migrated=False, whole_load=(1, 8.0))
    assert st.lessons.joining("plain", 1) > 6
    assert not any(_request(st).probe for _ in range(20))
    now[0] += 300.0  # the lesson of the bursts has faded
    assert sum(_request(st).probe for _ in range(20)) == 4


def test_topology_probes_let_served_rounds_rank_the_topologies():
    """The calibration prices co-located a little ahead of separate (1.52x against 1.45x). While
    served separate rounds at batch 1 are unmeasured, a share of the auto requests that would go
    co-located run separate instead; when those rounds come back 1.3x faster than the co-located
    steps measured beside them, auto sends the traffic to the separate topology, and the probes stop."""
    now = [0.0]
    st = _state(now)
    loads = {"plain": PoolLoad(), "colocated": PoolLoad(), "separate": PoolLoad()}
    cm = st.cost_model()
    for _ in range(3):  # served plain and co-located steps as calibrated: no cost probes for them
        st.observe_timing("plain", 1, RequestStats(plain_steps=9, prompt_tokens=16, output_tokens=8),
                          cm.plain_time_per_token(1), CLS)
        colocated = _finished(3, 20, 2 / 3)
        colocated.prompt_tokens, colocated.output_tokens = 16, 60
        st.observe_timing("colocated", 1, colocated,
                          cm.calibrated_step_time(1, 3) / colocated.mean_acceptance_length, CLS)
    routes = [_request(st, loads) for _ in range(20)]
    probes = [r for r in routes if r.probe]
    assert all(r.pool == "colocated" for r in routes if not r.probe)
    assert len(probes) == 4 and all(r.pool == "separate" and "cost probe" in r.decision.reason for r in probes)
    assert all(r.decision.k > 0 and not r.adaptive for r in probes)
    for r in probes[:3]:  # three probes finish: rounds 1.3x faster per token than co-located steps
        stats = _finished(r.decision.k, 20, 2 / 3)
        stats.prompt_tokens, stats.output_tokens = 16, 60
        colocated_per_token = cm.spec_time_per_token(1, r.decision.k, stats.accepted / sum(stats.proposed_per_position))
        st.observe_timing("separate", 1, stats, colocated_per_token / 1.3, CLS)
    after = [_request(st, loads) for _ in range(20)]
    assert not any(r.probe for r in after)
    assert all(r.pool == "separate" and r.adaptive for r in after)


def test_on_shared_cores_the_other_topology_is_not_probed():
    """On shared cores a separate round runs a co-located step's forwards plus its hops on the same cores:
    served at concurrency 1, its probes ran at 2.6x co-located's time per token and cost auto 9% of a
    32-request run. With the load's cores shared, the auto requests that go co-located all stay there."""
    now = [0.0]
    st = _state(now, shared_compute=True)
    loads = {"plain": PoolLoad(), "colocated": PoolLoad(), "separate": PoolLoad()}
    cm = st.cost_model()
    for _ in range(3):
        st.observe_timing("plain", 1, RequestStats(plain_steps=9, prompt_tokens=16, output_tokens=8),
                          cm.plain_time_per_token(1), CLS)
    routes = [_request(st, loads) for _ in range(40)]
    assert all(r.pool == "colocated" and not r.probe for r in routes)


def test_no_topology_probe_where_the_other_topology_would_not_pay():
    """A separate topology priced at a loss (a 30 ms hop per round) is never probed."""
    now = [0.0]
    st = _state(now)
    st.separate_hop_s = 0.030
    st.set_costs(_costs(), "test")
    loads = {"plain": PoolLoad(), "colocated": PoolLoad(), "separate": PoolLoad()}
    routes = [_request(st, loads) for _ in range(40)]
    assert all(r.pool in ("plain", "colocated") for r in routes)


def test_cost_probes_find_speculation_that_the_calibration_undersells():
    """Calibrated, speculation breaks even at the prior acceptance (0.6), so auto starts plain. Served,
    a plain step costs 1.4x its calibrated price and a speculative step what it was calibrated at
    (the replica's loop and streaming, paid per step, are spread over several tokens). Cost probes
    measure speculative steps while that side is unmeasured; then the class speculates."""
    now = [0.0]
    tracker = AcceptanceTracker(prior_mean=0.6, prior_weight=20, half_life_s=60.0, clock=lambda: now[0])
    st = RouteState("d", tracker, k_max=8, default_k=4, context_limit=512, domains=DomainTable(promote_after=1),
                    exploration=Exploration(share=0.05, min_interval_s=1.0), clock=lambda: now[0])
    batches, qs = (1, 2, 4, 8), (1, 2, 3, 5, 9)
    st.set_costs(StepCosts(batches, qs, tuple(tuple(0.010 + 0.003 * (q - 1) + 0.0002 * b * q for q in qs)
                                              for b in batches), tuple(0.003 for _ in batches), source="s"), "test")
    cm = CostModel(st.costs)
    assert _request(st).pool == "plain"
    routes = []
    for _ in range(40):
        now[0] += 1.0
        r = _request(st)
        routes.append(r)
        if r.pool == "plain":
            st.learn("plain", 1, CLS, RequestStats(plain_steps=31, prompt_tokens=16, output_tokens=30),
                     1.4 * cm.plain_time_per_token(1), migrated=False)
        else:
            stats = RequestStats(prompt_tokens=16, output_tokens=60)
            for i in range(30):  # acceptance 0.6, the prior: the probes teach the served cost, not a better draft
                stats.record_verify(r.decision.k, round((i + 1) * 0.6 * r.decision.k) - round(i * 0.6 * r.decision.k))
            st.learn(r.pool, 1, CLS, stats, cm.calibrated_step_time(1, stats.proposed // stats.verify_steps)
                     / stats.mean_acceptance_length, migrated=False)
    cost = [r for r in routes if r.probe and "cost probe" in r.decision.reason]
    assert len(cost) == 3 and all(r.pool == "colocated" for r in cost)
    assert all(r.pool == "colocated" and r.adaptive for r in routes[-10:])


def test_separate_rounds_as_calibrated_teach_no_drift():
    """A separate request whose rounds ran exactly at their calibrated price: K=4, two of four draft
    tokens kept a round (three judged: acceptance 2/3, though only half the proposed tokens were
    kept) teaches a factor of 1."""
    now = [0.0]
    st = _state(now)
    stats = _finished(4, 30, 0.5)
    stats.prompt_tokens, stats.output_tokens = 16, 60
    per_token = CostModel(st.costs).spec_time_per_token(1, 4, 2 / 3, "separate")
    for _ in range(3):
        st.observe_timing("separate", 1, stats, per_token, CLS)
    assert st.drift.buckets[0].separate == pytest.approx(1.0)
