"""Routing helpers shared by the router-state tests: a ``RouteState`` on a frozen clock, a routed
request, a finished request's stats as an engine records them."""

from __future__ import annotations

from served import synthetic_costs

from autoscaling.routing import PoolLoad
from autoscaling.traffic_classes import DomainTable
from deployments.route_state import RouteState
from specdec_core.acceptance import AcceptanceTracker, TrafficClass
from specdec_core.stats import RequestStats

ALL = {"plain": PoolLoad(), "colocated": PoolLoad(), "separate": PoolLoad()}


def route_state(a=0.9, evidence=0, costs=None, **kw) -> RouteState:
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
    st = state or route_state(costs=synthetic_costs())
    cls = st.traffic_class(temperature, domain)
    f = st.features(temperature=temperature, top_p=1.0, max_tokens=max_tokens, prompt_tokens=prompt_tokens,
                    mode=mode, k=k, topology=topology, objective=objective, cls=cls)
    return st.decide(f, loads)


def served_stats(k: int, decode_steps: int, budget_tail: bool = False, plain_decode: int = 0) -> RequestStats:
    """A finished request's stats as the engine records them: the prefill's pass counts as a plain
    step; K=k decode steps accepting 2 of k each; optional K=0 decode steps."""
    stats = RequestStats()
    stats.record_verify(0, 0)  # the prefill
    for _ in range(decode_steps):
        stats.record_verify(k, min(2, k))
    for _ in range(plain_decode + budget_tail):
        stats.record_verify(0, 0)
    return stats
