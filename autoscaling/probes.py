"""Exploration probes: auto requests run where routing did not put them, so that what routing prices
stays measured (``autoscaling/routing.py`` decides; ``autoscaling/exploration.py`` schedules).

- acceptance probes (``probe_route``): a class that goes plain for its acceptance runs a few requests
  on speculation with a fixed K, so that its estimate can recover;
- cost probes (``cost_probe_route``, ``topology_probe_route``): while the served steps of the side a
  decision does not take are unmeasured at its batch, a share of requests runs there, so that a
  calibration that flatters one side is found out.

Pure functions over a ``RoutingContext``, like the routing policy.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from dataclasses import replace

from autoscaling.exploration import Exploration
from autoscaling.routing import (
    PLAIN_POOL,
    SPEC_TOPOLOGIES,
    RoutingContext,
    RoutingDecision,
    spec_options,
)

# Plain decisions that a higher acceptance could turn: a class routed plain for one of these may probe.
ACCEPTANCE_REGIMES = ("domain_mismatch", "high_entropy", "expensive_draft", "no_gain")
PROBE_ACCEPTANCE = 0.9  # a probe runs only where speculation would pay at this acceptance
PROBE_K = 2  # a probe's fixed K: every step judges draft tokens, and a wrong draft costs little


def probe_route(ctx: RoutingContext, plain: RoutingDecision) -> RoutingDecision | None:
    """An exploration probe for an auto request that ``route`` sent plain for its acceptance: the
    spec pool with room where speculation would pay at ``PROBE_ACCEPTANCE``, with K = ``PROBE_K``;
    None where even a good draft would not pay (a large batch, a prefill-heavy request)."""
    f = ctx.features
    if plain.pool != PLAIN_POOL or plain.regime not in ACCEPTANCE_REGIMES or f.mode != "auto" or f.k is not None \
            or f.objective != "latency":
        return None
    hopeful = [o for o in spec_options(replace(ctx, acceptance=PROBE_ACCEPTANCE))
               if o.choice.predicted_speedup > 1.0 + ctx.thresholds.margin and ctx.loads[o.topology].has_room()]
    if not hopeful:
        return None
    opt = max(hopeful, key=lambda o: o.choice.predicted_speedup)
    cm = ctx.cost_models[opt.topology]
    speedup = cm.plain_time_per_token(opt.batch) / cm.spec_time_per_token(opt.batch, PROBE_K, ctx.acceptance,
                                                                          opt.topology)
    return RoutingDecision(opt.topology, opt.topology, PROBE_K, plain.regime, speedup,
                           f"exploration probe, K={PROBE_K}: the class goes plain for its acceptance "
                           f"(a={ctx.acceptance:.2f} on {ctx.evidence:.0f} judged tokens)")


def cost_probe_route(ctx: RoutingContext, spec: RoutingDecision) -> RoutingDecision | None:
    """A plain run of an auto request that ``route`` sent to speculation, while the served cost of
    plain steps at its batch is unmeasured (the caller knows; it schedules these probes): without
    it the router would compare measured speculative steps against a calibrated plain step."""
    f = ctx.features
    if spec.pool == PLAIN_POOL or f.mode != "auto" or f.k is not None or f.topology is not None \
            or PLAIN_POOL not in ctx.loads:
        return None
    return RoutingDecision(PLAIN_POOL, None, 0, spec.regime, 1.0,
                           f"cost probe: served plain steps at batch {ctx.loads[PLAIN_POOL].joined_batch()} "
                           "not measured yet")


def topology_probe_route(ctx: RoutingContext, spec: RoutingDecision) -> RoutingDecision | None:
    """An auto request that ``route`` sent to one speculative topology, run on the other instead,
    where that one would pay too (predicted speedup above the margin, room for it): the caller
    schedules these while the other's served rounds at its batch are unmeasured. The calibration
    times both topologies' forwards in one process; their served costs differ by more than the two
    predictions do (hops, overlap on the other core), so only served rounds can rank them."""
    f = ctx.features
    if spec.pool not in SPEC_TOPOLOGIES or f.mode != "auto" or f.k is not None or f.topology is not None:
        return None
    other = [o for o in spec_options(ctx) if o.topology != spec.pool and o.choice.k > 0
             and o.choice.predicted_speedup > 1.0 + ctx.thresholds.margin and ctx.loads[o.topology].has_room()]
    if not other:
        return None
    opt = other[0]
    return RoutingDecision(opt.topology, opt.topology, opt.choice.k, spec.regime, opt.choice.predicted_speedup,
                           f"cost probe: served {opt.topology} rounds at batch {opt.batch} not measured yet "
                           f"(K={opt.choice.k}, a={ctx.acceptance:.2f})")


def scheduled_probe(ctx: RoutingContext, decision: RoutingDecision, acceptance_probes: Exploration,
                    cost_probes: Exploration, measured: Callable[[int, str], tuple[Hashable, bool]], now: float
                    ) -> RoutingDecision | None:
    """The probe to run instead of ``decision``, if one is due at ``now``: an acceptance probe for a
    class that goes plain for its acceptance (``probe_route``, on the class's schedule), else a cost
    probe while the served steps of the side ``decision`` does not take are unmeasured at the
    request's batch, on the schedule of its batch bucket: plain decoding (``cost_probe_route``), the
    other speculative topology (``topology_probe_route``), or the acceptance probe's speculation
    (a calibration that undersells served speculation keeps a class plain, and only served
    speculative steps can say so). ``measured(batch, kind)`` gives that bucket and whether served
    steps of ``kind`` ("plain", "colocated", "separate") are measured there; on shared cores a cost probe
    runs only where no other pool's rows would decode beside it, now or joining the load while it decodes
    (``PoolLoad.joining``: beside them its steps teach no drift, ``RouteState._ran_alone``, and the probes
    would go on forever: in bursts of 8 on the tiny family the first request of each, joining an idle
    load, went to the separate topology, 12-17% of the auto requests). None: run ``decision``."""
    spec = probe_route(ctx, decision)
    if spec is not None and acceptance_probes.probe_due(ctx.features.traffic_class, now):
        return spec
    # On shared cores a separate round is a co-located step's forwards plus its hops, on the same cores, so
    # the other topology is not probed: it runs where it is priced ahead, and is measured there. Probed, 3 of
    # 32 auto requests at concurrency 1 ran separate at 2.6x co-located's time per token (auto 0.91x of it).
    topology = None if ctx.shared_compute else topology_probe_route(ctx, decision)
    for probe in (cost_probe_route(ctx, decision), topology, spec):
        if probe is None or ctx.shared_compute and (ctx.loads[probe.pool].beside or ctx.loads[probe.pool].joining >= 1):
            continue  # on shared cores a step beside another pool's rows (now, or joining) measures no cost of its own
        bucket, seen = measured(ctx.loads[probe.pool].joined_batch(), probe.pool)
        if not seen:
            if not cost_probes.probe_due((probe.pool, bucket), now):
                return None
            return probe if probe is not spec else replace(
                spec, reason=f"cost probe: served {spec.pool} steps at batch "
                             f"{ctx.loads[spec.pool].joined_batch()} not measured yet (K={spec.k})")
    return None
