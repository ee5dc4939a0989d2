"""Router-side glue between the live service and the pure routing policy (no Ray here).

``RouteState`` holds what the router knows: the step costs (calibrated by a co-located replica,
or a prior table until they arrive), the `AcceptanceTracker` of finished speculative requests,
and the routing settings. It builds `autoscaling.routing.RoutingContext` from a request's
features and the pools' live loads, calls `route()`, and answers `/v1/regimes`. Policy logic
stays in ``autoscaling/``; cost and acceptance logic in ``specdec_core/``.

Traffic class of a request: (draft name, temperature bucket, domain), domain = the OpenAI
``user`` field, bounded by ``autoscaling.traffic_classes.DomainTable`` (frequent users keep their
own, the rest share hashed buckets), or "default" (``specdec_core.acceptance.TrafficClass``).
"""

from __future__ import annotations

import dataclasses
import os
import time
from collections.abc import Callable, Mapping

from autoscaling.exploration import Exploration
from autoscaling.probes import scheduled_probe
from autoscaling.regimes import RoutingThresholds
from autoscaling.routing import (
    PLAIN_POOL,
    POOLS,
    SPEC_TOPOLOGIES,
    Pool,
    PoolLoad,
    RequestFeatures,
    RoutingContext,
    RoutingDecision,
    RoutingError,
    route,
)
from autoscaling.traffic_classes import DomainTable
from deployments.config import AppConfig, model_label
from deployments.load_lessons import LoadLessons
from specdec_core.acceptance import AcceptanceTracker, TrafficClass
from specdec_core.adaptive import AdaptiveK
from specdec_core.cost_view import CostView
from specdec_core.costmodel import CostModel
from specdec_core.drift import StepDrift
from specdec_core.request import RequestState
from specdec_core.stats import RequestStats
from specdec_core.step_costs import SEPARATE_HOP_S, StepCosts

# Prior step costs until a co-located replica's calibration arrives: docs/ARCHITECTURE.md's CPU table (Facts)
# (17M target, 1.9M draft, fp32, 2 threads, context 64), seconds. Only q = 1 and 9 were measured;
# q in between is interpolated linearly.
PRIOR_COSTS = StepCosts(
    batches=(1, 8, 32, 128),
    qs=(1, 9),
    target_s=((18.7e-3, 29.9e-3), (31.1e-3, 63.3e-3), (64.8e-3, 207e-3), (161e-3, 548e-3)),
    draft_s=(5.7e-3, 8.6e-3, 11.4e-3, 23.2e-3),
    source="prior:ARCHITECTURE.md-table",
)

# OpenAI `service_tier` values that mean "bulk, latency does not matter": the throughput objective.
THROUGHPUT_TIERS = ("flex", "batch", "scale")
SERVED_DRIFT_BOUNDS = (0.5, 4.0)  # served / calibrated step time believed as drift (beyond: another machine's costs)
SERVED_DRIFT_WEIGHT = 0.2  # per finished request
SERVED_DRIFT_MIN_REQUESTS = 3  # finished requests on each side of a batch bucket before its drift applies
# On shared cores, a request teaches the served drift only where other pools held at most this share of the rows
# while it ran (``RouteState._ran_alone``).
ALONE_SHARE = 0.1


def objective_of(requested: str | None, service_tier: str | None) -> str:
    """`speculation.objective` wins; else a bulk `service_tier` means throughput; else latency."""
    if requested:
        return requested
    return "throughput" if (service_tier or "").lower() in THROUGHPUT_TIERS else "latency"


def with_hops(costs: StepCosts, separate_hop_s: float, separate_overlap: str = "auto") -> StepCosts:
    """The same measured forwards with this service's hop overheads (co-located: 0), and whether its
    separate topology overlaps draft and verify (config ``separate_overlap``)."""
    return dataclasses.replace(costs, hop_overhead_s={"colocated": 0.0, "separate": float(separate_hop_s)},
                               overlapped=() if separate_overlap == "never" else ("separate",))


@dataclasses.dataclass(frozen=True)
class Route:
    """A routing decision as the router runs it."""

    decision: RoutingDecision
    pool: str  # the deployed pool that runs it (plain decoding falls back to a spec pool with K=0)
    batch: int  # per-replica batch the request joins (for the realised speedup)
    adaptive: bool  # auto-mode speculation: the replica (or the separate loop) re-chooses K <= decision.k every step
    traffic_class: TrafficClass
    probe: bool = False  # an exploration probe: fixed K, so that every step judges draft tokens


class RouteState:
    def __init__(
        self,
        draft_name: str | None,
        tracker: AcceptanceTracker,
        k_max: int,
        default_k: int,
        context_limit: int,
        separate_hop_s: float = SEPARATE_HOP_S,
        separate_overlap: str = "auto",
        thresholds: RoutingThresholds | None = None,
        domains: DomainTable | None = None,
        exploration: Exploration | None = None,
        clock: Callable[[], float] = time.monotonic,
        budgeted: bool = False,
        shared_compute: bool = False,
    ):
        self.draft_name = draft_name or "none"
        self.tracker = tracker
        self.k_max = k_max
        self.default_k = default_k
        self.context_limit = context_limit
        self.separate_hop_s = separate_hop_s
        self.separate_overlap = separate_overlap
        self.thresholds = thresholds or RoutingThresholds()
        self.domains = domains or DomainTable()
        self.exploration = exploration or Exploration()
        # cost probes: 4x the acceptance probes' share, and only while a bucket's plain side is unmeasured
        self.cost_probes = Exploration(share=min(1.0, 4 * self.exploration.share), min_interval_s=0.0)
        self.clock = clock
        # co-located replicas plan every step for the batch (config budgeted_verification): priced so
        self.budgeted = frozenset({Pool.COLOCATED}) if budgeted else frozenset()
        self._separate_adaptive: AdaptiveK | None = None
        self.lessons = LoadLessons(shared_compute, clock)  # rows joining, steps declined, waits: per pool and batch
        self.set_costs(PRIOR_COSTS)

    @classmethod
    def from_config(cls, cfg: AppConfig, context_limit: int, clock: Callable[[], float] = time.monotonic,
                    cpus: int | None = None) -> RouteState:
        """The router's state as the app's config sets it up, on a node of ``cpus`` CPUs (None: this one's)."""
        tracker = AcceptanceTracker(cfg.acceptance_prior, cfg.acceptance_prior_weight, cfg.acceptance_half_life_tokens,
                                    half_life_s=cfg.acceptance_half_life_s, clock=clock)
        return cls(model_label(cfg.draft), tracker, cfg.k_max, cfg.default_k, context_limit,
                   cfg.separate_hop_overhead_s, cfg.separate_overlap,
                   RoutingThresholds(margin=cfg.route_margin, split_margin=cfg.route_split_margin),
                   DomainTable(cfg.max_traffic_classes, cfg.traffic_class_buckets, cfg.traffic_class_promote_after),
                   Exploration(cfg.probe_share), clock, cfg.budgeted_verification,
                   cfg.pools_share_compute_on(cpus or os.cpu_count() or 1))

    # ---- costs -------------------------------------------------------------------------------
    def set_costs(self, costs: StepCosts, source: str | None = None, sampled_costs: StepCosts | None = None
                  ) -> None:
        """The step costs to price with (the co-located replicas' calibration), greedy and sampled."""
        self.costs = with_hops(costs, self.separate_hop_s, self.separate_overlap)
        self.costs_source = source or costs.source
        # What served requests measure against these costs (new costs: nothing learnt yet). A served
        # step also pays the replica's loop and streaming: measured 1.4-2.2x an engine step here, so
        # the bounds on a believable drift are wider than inside an engine. The router owns this
        # drift; adaptive requests carry it to the replica, which prices with it too (one view).
        # One observation is one finished request, whose time per token averages its dozens of steps:
        # a few of them on each side are evidence enough, and each weighs more than an engine step.
        sampled = with_hops(sampled_costs, self.separate_hop_s, self.separate_overlap) if sampled_costs else None
        self.view = CostView(self.costs, sampled,
                             StepDrift(weight=SERVED_DRIFT_WEIGHT, min_steps=SERVED_DRIFT_MIN_REQUESTS,
                                       bounds=SERVED_DRIFT_BOUNDS))
        if self._separate_adaptive is not None:
            self._separate_adaptive.view = self.view
            self._separate_adaptive.adopt_drift(self.drift)

    @property
    def shared_compute(self) -> bool:
        """The pools' engines share their cores (``AppConfig.pools_share_compute_on``): priced at the whole load."""
        return self.lessons.shared_compute

    @property
    def drift(self) -> StepDrift:
        return self.view.drift

    def cost_model(self, greedy: bool = True, context_len: int = 0) -> CostModel:
        return self.view.model(greedy, context_len)

    def separate_adaptive(self, tracker: AcceptanceTracker) -> AdaptiveK:
        """The separate loop's adaptive K: the engines' own (``AdaptiveK``), priced for the separate
        topology with this state's view, and its drift (one owner, as the engine replicas adopt it)."""
        self._separate_adaptive = AdaptiveK(self.view, tracker, self.draft_name, "separate")
        self._separate_adaptive.adopt_drift(self.drift)
        return self._separate_adaptive

    def overlaps(self, batch: int, k: int, req: RequestState) -> bool:
        """Does the separate loop's Draft propose a request's next round during this one's verify?
        Where ``CostModel.overlap_pays`` at this batch, K and the request's acceptance (its own
        judged tokens shrunk towards its class's estimate), or as config ``separate_overlap`` forces."""
        if self.separate_overlap != "auto":
            return self.separate_overlap == "always"
        params, stats = req.params, req.stats
        class_a = params.class_acceptance if params.class_acceptance is not None else self.tracker.prior_mean
        a = self.tracker.shrink(stats.accepted, sum(stats.proposed_per_position), class_a)
        return self.cost_model(params.temperature <= 0, len(req.tokens)).overlap_pays(batch, k, a)

    @property
    def calibrated(self) -> bool:
        return not self.costs_source.startswith("prior")

    # ---- inputs --------------------------------------------------------------------------------
    def traffic_class(self, temperature: float, user: str | None) -> TrafficClass:
        """The class a request counts under; a user pushed out of the bounded table loses its statistics."""
        assigned = self.domains.assign(user)
        if assigned.demoted is not None:
            self.tracker.forget_domain(assigned.demoted)
            self.exploration.forget_domain(assigned.demoted)
        return TrafficClass.of(self.draft_name, temperature, assigned.domain)

    def features(self, *, temperature: float, top_p: float, max_tokens: int, prompt_tokens: int, mode: str,
                 k: int | None, topology: str | None, objective: str, cls: TrafficClass) -> RequestFeatures:
        if k is None and (mode == "speculative" or topology is not None):
            k = self.default_k  # explicit speculation without K: the configured default
        return RequestFeatures(temperature, top_p, max_tokens, prompt_tokens, mode, k, topology, objective, cls)

    def context(self, features: RequestFeatures, loads: Mapping[str, PoolLoad]) -> RoutingContext:
        cls = features.traffic_class
        spec = [t for t in SPEC_TOPOLOGIES if t in loads]
        loads = {p: dataclasses.replace(load, declined=self.lessons.declined(p, load.decode_batch(), cls),
                                        waits=self.lessons.waits_beside_plain(p, load.decode_batch())) if p in spec
                 else load for p, load in loads.items()}
        return RoutingContext(
            features=features,
            loads=loads,
            cost_models=dict.fromkeys(spec, self.view.model_for(cls, features.prompt_tokens)),
            short_context_models=dict.fromkeys(spec, self.view.model_for(cls)),
            acceptance=self.tracker.estimate(cls),
            evidence=self.tracker.evidence(cls),
            context_limit=self.context_limit,
            k_max=self.k_max,
            thresholds=self.thresholds,
            budgeted=self.budgeted,
            shared_compute=self.shared_compute,
        )

    # ---- decision ------------------------------------------------------------------------------
    def decide(self, features: RequestFeatures, loads: Mapping[str, PoolLoad]) -> Route:
        """`route()` over the deployed pools (``loads`` holds only those); a class that goes plain
        for its acceptance sends its scheduled probes to speculation. Raises RoutingError."""
        loads = self.priced_loads(loads)
        ctx = self.context(features, loads)
        d = route(ctx)
        probe = scheduled_probe(ctx, d, self.exploration, self.cost_probes, self._measured, self.clock())
        if probe is not None:
            return Route(probe, probe.pool, loads[probe.pool].joined_batch(), False, features.traffic_class, True)
        pool = d.pool
        if pool == PLAIN_POOL and PLAIN_POOL not in loads:
            pool = next((p for p in POOLS if p in loads), None)  # a spec pool decodes plain with K=0
            if pool is None:
                raise RoutingError("no pool is deployed")
        # Adaptive K runs in a co-located replica's engine, and in the separate loop's scheduler (the same AdaptiveK).
        adaptive = features.mode == "auto" and features.k is None and d.k > 0 and pool in SPEC_TOPOLOGIES
        return Route(d, pool, loads[pool].joined_batch(), adaptive, features.traffic_class)

    def priced_loads(self, loads: Mapping[str, PoolLoad]) -> dict[str, PoolLoad]:
        """The pools' loads as routing prices them: with the rows that have been joining requests that
        joined them at such a batch, and, where the pools share their cores, the other pools' rows."""
        rows = {p: load.active + load.queued for p, load in loads.items()}
        total = sum(rows.values())
        shared = {p: dataclasses.replace(load, beside=total - rows[p] if self.shared_compute else 0)
                  for p, load in loads.items()}
        priced = {}
        for p, load in shared.items():
            shares = self.lessons.joining_shares(p, load.whole_batch())
            priced[p] = dataclasses.replace(load, joining=sum(rows * share for rows, share in shares),
                                            joining_shares=shares)
        return priced

    def _measured(self, batch: int, kind: str) -> tuple[int, bool]:
        """The drift bucket of ``batch`` and whether served steps of ``kind`` (a pool) are measured there."""
        return self.drift.bucket(batch), self.drift.measured(batch, kind)

    # ---- feedback ------------------------------------------------------------------------------
    def learn(self, pool: str, batch: int, cls: TrafficClass, stats: RequestStats, seconds_per_token: float,
              migrated: bool, whole_load: tuple[int, float] | None = None, ttft_s: float | None = None) -> None:
        """A request finished: its judged draft tokens teach the acceptance estimate of its class, its
        measured time per token the served drift (not after a migration: a re-prefill is no step time)
        at the batch its decode steps ran in (``batch``, the one it joined, only when it ran none: in a
        closed loop a request that joined an idle pool decodes beside the ones that follow it, and
        timing learnt at the joined batch put batch-8 steps in the batch-1 bucket, 2.3x its calibration),
        and its TTFT (``ttft_s``, by the router's clock) and prefill waits its pool's ``waits`` there.
        Where the pools share their cores, the rows that joined it are the whole load's: ``whole_load``
        = (all pools' rows once it joined, their mean while it ran), per replica of its pool."""
        shared = self.shared_compute and whole_load is not None and whole_load[1]
        if not migrated:
            if shared:
                self.lessons.learn_joining(pool, *whole_load)
            elif not self.shared_compute and stats.mean_decode_batch:
                self.lessons.learn_joining(pool, batch, stats.mean_decode_batch)
        alone = not migrated and self._ran_alone(stats, whole_load)
        if alone and ttft_s is not None and stats.decode_s > 0:
            self.lessons.learn_waits(pool, whole_load[1] if shared else stats.mean_decode_batch or batch, ttft_s, stats)
        if seconds_per_token and alone:
            self.observe_timing(pool, stats.mean_decode_batch or batch, stats, seconds_per_token, cls)
        if stats.proposed:
            self.observe(cls, stats)

    def _ran_alone(self, stats: RequestStats, whole_load: tuple[int, float] | None) -> bool:
        """Did the request's pool have the cores to itself while it decoded (always, where pools do not
        share them)? On shared cores a step beside another pool's rows measures their contention, not its
        own cost: a plain request that decoded beside co-located rows read its steps 1.27x the calibration
        where plain alone read 1.07x, and that drift made speculation at batch 8 look cheaper than plain."""
        if not self.shared_compute or whole_load is None or not stats.mean_decode_batch:
            return True
        return whole_load[1] - stats.mean_decode_batch <= ALONE_SHARE * whole_load[1]

    def observe(self, cls: TrafficClass, stats: RequestStats) -> None:
        """A finished request's speculation stats: judged positions per position
        (``proposed_per_position``) and accepted per position, the MLE of acceptance.py."""
        judged = stats.proposed_per_position
        if sum(judged):
            self.tracker.observe_request(cls, judged, stats.accepted_per_position, stats.verify_steps or 1)

    def observe_timing(self, pool: str, batch: float, stats: RequestStats, seconds_per_token: float,
                       cls: TrafficClass | None = None) -> None:
        """A finished request's measured decode time per token against the step the cost model
        priced, learnt per batch bucket for plain steps, co-located speculative steps and the
        separate topology's rounds (``StepDrift``). The calibration times engine steps; a served
        step also pays the replica's loop and streaming, which a speculative step spreads over
        several tokens, so served speculation can pay where the engine-step costs say it does not;
        and the separate topology's rounds pay hops and overlap the draft with the verify on
        another process, which no calibrated step measures. A co-located request that adaptive K
        moved between step shapes teaches by its steps of each K (``StepDrift.observe_mixed``); a
        separate one only when all its rounds had one shape."""
        verify = stats.verify_steps
        # a fixed-K request may end on a K=0 step (its token budget): one such decode step still leaves
        # the request a K-token one.
        plain_decode = stats.plain_decode_steps
        spec_ks = sum(1 for k, n in enumerate(stats.proposal_lengths) if k and n)
        ran_plain = verify and plain_decode > 1  # adaptive K moved it between plain and speculative steps
        if pool not in POOLS or seconds_per_token <= 0:
            return
        if pool == "separate" and (not verify or ran_plain):
            return  # no round measured (its draft failed), or plain steps beside its rounds in one time per token
        k = round(stats.proposed / verify) if verify else 0
        context = stats.prompt_tokens + stats.output_tokens // 2  # its decode steps, on average
        # Priced as the batches it decoded in ran: by their share of sampled rows, as the engine prices and
        # learns a step (a greedy request beside T=1 rows, priced on its own path, read as a slow greedy step)
        model = (self.view.model_at(stats.sampled_share, context) if stats.decode_batch_rows
                 else self.view.model_for(cls, context) if cls is not None else self.cost_model())
        if pool == "separate":  # a round's time per token, at the acceptance the request met (accepted / judged)
            a = stats.accepted / max(1, sum(stats.proposed_per_position))
            calibrated = CostModel(model.costs).spec_time_per_token(batch, k, a, "separate")
            self.drift.observe(k, seconds_per_token, calibrated, batch, "separate")
            return
        if ran_plain or spec_ks > 1:
            steps = [plain_decode, *stats.proposal_lengths[1:]]
            decode_tokens = plain_decode + verify + stats.accepted
            self.drift.observe_mixed(steps, seconds_per_token * decode_tokens,
                                     lambda step_k: model.calibrated_step_time(batch, step_k), batch)
            return
        measured = seconds_per_token * (stats.mean_acceptance_length if verify else 1.0)
        self.drift.observe(k, measured, model.calibrated_step_time(batch, k), batch)

    def realised_speedup(self, batch: float, seconds_per_token: float) -> float | None:
        """Plain step time per token at this batch (the cost model) / the request's measured decode
        time per token; ~1 for plain requests when the costs are right."""
        if seconds_per_token <= 0:
            return None
        return self.cost_model().plain_time_per_token(batch) / seconds_per_token
