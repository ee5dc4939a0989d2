"""Routing policy: which pool serves a request, with which K, and why.

Pools: "plain" (PlainDecoder replicas), "colocated" (draft and target in one
replica) and "separate" (the router's loop: a propose message to the Draft and a
verify message to the Target per step, the draft's next round overlapped with
the verify where that pays). The policy is a pure function `route(ctx)`; the router
deployment builds the `RoutingContext` from the request, its pool counters,
the cost models and the acceptance tracker.

Rules, in order:
1. Explicit request fields win: mode "plain" or k = 0 -> plain pool; mode
   "speculative", k > 0 or a topology -> speculation, K from the request or the
   cost model's best K >= 1. Inconsistent or out-of-range fields raise
   `RoutingError` (a ValueError: HTTP 400 at the edge).
2. auto, objective "throughput" (bulk traffic) -> plain pool: speculation
   spends compute that a wider plain batch turns into throughput.
3. auto, latency: for each spec topology with replicas, evaluate the cost
   model's best K at the batch the request would join (the pool's active +
   queued + 1 sequences spread over its replicas, and where pools share their
   cores the other pools' rows: ``PoolLoad.beside``) plus the rows the pool's
   finished requests saw join them while they decoded (``PoolLoad.joining_shares``,
   learnt by the router: priced over those outcomes, not at their mean); speculate in the fastest
   pool with room if its predicted speedup > 1 + margin and the request is not
   prefill heavy, else plain. On shared cores the request stays with the load:
   it joins the pool that holds most rows unless another is predicted
   ``split_margin`` faster (two busy engines on the same cores serve less than
   either alone), in a speculative pool while speculation there is within
   ``split_margin`` of plain. A pool whose adaptive K ran most steps of the auto requests of this
   class recently sent there at this batch plain (``PoolLoad.declined``: the engine measured its
   speculative steps losing to its plain ones) is not sent more of them: they would decode plain
   there, beside the plain pool's rows on the same cores, where the plain pool serves them whole.
   Every option is priced over the whole request (``whole_request``): its decode steps at the cost model's
   price, and its TTFT and the other requests' prefills it waits for as each pool's requests measured them
   at that batch (``PoolLoad.waits``).

Probes (``autoscaling/probes.py``, scheduled by ``autoscaling/exploration.py``): a class that rule 3
keeps sending plain for its acceptance gets a few probe requests on speculation (``probe_route``) so
that its estimate can recover; and
while the served cost of plain steps at a batch is unmeasured, a share of the auto requests rule 3
sends to speculation run plain instead (``cost_probe_route``), so that the served costs of both
sides are learnt and a calibration that flatters speculation is found out; and while the other
speculative topology's served rounds are unmeasured, a share runs there (``topology_probe_route``; not
on shared cores, where a separate round is a co-located step's forwards plus hops).

Every decision carries a regime label (``autoscaling/regimes.py``): why speculation does or does not pay
for this request.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Mapping
from dataclasses import dataclass, field, replace

from autoscaling.regimes import RegimeEvidence, RoutingThresholds, classify_regime
from specdec_core.acceptance import TrafficClass
from specdec_core.costmodel import CostModel, KChoice
from specdec_core.step_planner import budgeted_choice

MODES = ("auto", "speculative", "plain")
OBJECTIVES = ("latency", "throughput")


class Pool(enum.StrEnum):
    """The pools a request can run in (a StrEnum: it is its own name in JSON, metrics and config)."""

    PLAIN = "plain"  # plain-decoding replicas
    COLOCATED = "colocated"  # draft and target in one engine
    SEPARATE = "separate"  # Draft and Target deployments, the router's step loop


POOLS = tuple(Pool)
SPEC_TOPOLOGIES = (Pool.COLOCATED, Pool.SEPARATE)
PLAIN_POOL = Pool.PLAIN


class RoutingError(ValueError):
    """The request's explicit routing fields are invalid or cannot be served."""


@dataclass(frozen=True)
class RequestFeatures:
    temperature: float = 1.0
    top_p: float = 1.0
    max_tokens: int = 256
    prompt_tokens: int = 0
    mode: str = "auto"
    k: int | None = None
    topology: str | None = None
    objective: str = "latency"
    traffic_class: TrafficClass | None = None  # the router's key into the AcceptanceTracker


@dataclass(frozen=True)
class RequestWaits:
    """What a request of a pool waited for besides its own decode steps, as the pool's finished requests at a
    batch measured it: its time to first token, and the other requests' prefills per second of its own steps.
    Plain rows of one length finish together, so their successors' prefills batch into the successors' TTFT;
    speculative rows finish apart, so each successor's prefill runs in the rows beside it, and a row's TTFT
    waits for a longer step in flight (c=16, code: plain 1.08 s TTFT and 0.01 s of prefills per second of its
    steps, co-located 0.50 s and 0.34; BENCHMARKS.md, "The whole request priced")."""

    ttft_s: float
    prefill_wait_ratio: float

    def latency(self, decode_s: float) -> float:
        """A request's latency whose own decode steps take ``decode_s``."""
        return self.ttft_s + decode_s * (1.0 + self.prefill_wait_ratio)


@dataclass(frozen=True)
class PoolLoad:
    active: int = 0  # sequences decoding in the pool
    queued: int = 0  # sequences routed but not yet decoding
    replicas: int = 1
    capacity: int = 64  # sequences one replica decodes at once
    joining: float = 0.0  # rows that, as the pool's finished requests measured, join a request while it decodes
    #                       (negative: rows leave)
    joining_shares: tuple[tuple[int, float], ...] = ()  # what ``joining`` averages: (rows, share) of those requests
    beside: int = 0  # rows decoding in the other pools on the same cores (pools that share compute; else 0)
    probing: int = 0  # of active: exploration probes (they run where routing did not put them)
    # Share of their decode steps that the pool's adaptive K recently ran plain for auto requests of this
    # class at this batch: the engine's own verdict, from its measured steps, on the speculation routed there
    declined: float = 0.0
    # What its requests and the plain pool's waited for besides their own steps at this pool's decode batch
    # (plain's, this pool's), as finished requests measured it; None where either is unmeasured
    waits: tuple[RequestWaits, RequestWaits] | None = None

    def has_room(self) -> bool:
        return self.active + self.queued < self.replicas * self.capacity

    def joined_batch(self) -> int:
        """Per-replica batch once this request (and the queue) joins."""
        return math.ceil((self.active + self.queued + 1) / max(self.replicas, 1))

    def decode_batch(self) -> int:
        """The batch the request is priced at: the one it joins, plus the rows that join it while it
        decodes (in a burst or a closed loop, a request that joins an idle pool decodes beside the ones
        that arrive after it: priced at batch 1, it runs at the burst's batch), plus the rows of the
        pools that share its cores. Pools on shared cores are one engine's worth of compute split in
        processes: a request that speculates at batch 3 beside five plain rows takes its time from
        theirs, and only the whole load's batch says whether speculation pays."""
        return max(1, round(self.whole_batch() + self.joining))

    def decode_batches(self) -> tuple[tuple[int, float], ...]:
        """The batches the request may decode in, with their shares (``joining_shares``; without them,
        ``decode_batch`` alone), merged by power of two (each group at its shares' mean batch): a price per
        outcome was 5 ms a request for a budgeted pool at 16 outcomes, on the path to the first token."""
        if not self.joining_shares:
            return ((self.decode_batch(), 1.0),)
        groups: dict[int, tuple[float, float]] = {}  # batch.bit_length() -> (share, share-weighted batch)
        for rows, share in self.joining_shares:
            b = max(1, self.whole_batch() + rows)
            total, weighted = groups.get(b.bit_length(), (0.0, 0.0))
            groups[b.bit_length()] = (total + share, weighted + share * b)
        return tuple(sorted((max(1, round(weighted / total)), total) for total, weighted in groups.values() if total))

    def whole_batch(self) -> int:
        """Per-replica batch once this request joins, counting the rows of the pools that share its cores."""
        return math.ceil((self.active + self.queued + self.beside + 1) / max(self.replicas, 1))


@dataclass(frozen=True)
class RoutingContext:
    features: RequestFeatures
    loads: Mapping[str, PoolLoad]  # by pool: "plain", "colocated", "separate"
    cost_models: Mapping[str, CostModel]  # by spec topology, priced at the request's context
    acceptance: float  # estimate of a for the request's traffic class
    evidence: float = 0.0  # judged tokens behind it (AcceptanceTracker.evidence)
    context_limit: int = 2048
    k_max: int = 8
    thresholds: RoutingThresholds = field(default_factory=RoutingThresholds)
    # The same pools priced at the calibration's short context: whether the context decided (empty:
    # the context does not change the price)
    short_context_models: Mapping[str, CostModel] = field(default_factory=dict)
    # Topologies whose replicas plan every step for the batch (budgeted verification): priced by that
    # plan (``step_planner.budgeted_choice``) instead of one K for every row
    budgeted: frozenset[str] = frozenset()
    # The pools' engines share their cores (``PoolLoad.beside`` holds the other pools' rows): a request that
    # leaves the pool holding the load makes two engines contend for them
    shared_compute: bool = False


@dataclass(frozen=True)
class RoutingDecision:
    pool: str
    topology: str | None  # None for the plain pool
    k: int
    regime: str
    predicted_speedup: float  # over plain decoding at the batch the request joins
    reason: str


@dataclass(frozen=True)
class _Option:
    topology: str
    batch: int
    choice: KChoice
    declined: bool = False  # the pool's adaptive K ran such requests plain at this batch (``PoolLoad.declined``)


def price(model: CostModel, topology: str, batch: int, a: float, k_max: int, budgeted: bool = False) -> KChoice:
    """The best speculation ``topology`` offers at ``batch`` and acceptance ``a``: one K for the request
    (``CostModel.best_k``), or, in a pool that plans its steps (``budgeted``), what its plan would give a
    batch of such rows (each row priced at ``a`` per position, as the replica prices a row that carries
    the router's class estimate)."""
    if budgeted:
        return budgeted_choice(model, batch, (a,) * k_max, topology)
    return model.best_k(batch, a, k_max, topology)


def break_even_batch(model: CostModel, topology: str, a: float, k: int, k_max: int, budgeted: bool = False
                     ) -> int | None:
    """The smallest batch in the calibrated range where speculation stops paying: K=``k`` against plain,
    or, budgeted, the batch whose plan is plain. None: it pays across the range."""
    if not budgeted:
        return model.break_even_batch(a, k, topology)
    lo, hi = model.costs.batches[0], model.costs.batches[-1]
    return next((b for b in range(lo, hi + 1) if price(model, topology, b, a, k_max, True).k == 0), None)


def _best(ctx: RoutingContext, topology: str, batch: int, a: float, model: CostModel | None = None) -> KChoice:
    return price(model or ctx.cost_models[topology], topology, batch, a, ctx.k_max, topology in ctx.budgeted)


def _expected(ctx: RoutingContext, topology: str, load: PoolLoad) -> KChoice:
    """The best speculation ``topology`` offers over the batches the request may decode in
    (``PoolLoad.decode_batches``): its expected time per token against plain's at the same batches, with
    the K of the likeliest batch where speculation pays there. Priced at their mean batch, a request that
    opens a burst (rows join it) and one that ends a drain (none do) both look like batch 2, where a lone
    request's best pool is not the burst's."""
    outcomes = load.decode_batches()
    if len(outcomes) == 1:
        return _best(ctx, topology, outcomes[0][0], ctx.acceptance)
    model = ctx.cost_models[topology]
    priced = [(share, model.plain_time_per_token(b), _best(ctx, topology, b, ctx.acceptance)) for b, share in outcomes]
    plain = sum(share * plain_s for share, plain_s, _ in priced)
    spec = sum(share * plain_s / choice.predicted_speedup for share, plain_s, choice in priced)
    paying = [(share, choice.k) for share, _, choice in priced if choice.k]
    k = max(paying)[1] if paying and spec < plain else 0
    return KChoice(k, spec, plain / spec)


def whole_request(ctx: RoutingContext, topology: str, load: PoolLoad, choice: KChoice) -> KChoice:
    """``choice`` priced over the request's whole latency, not its decode steps alone: its TTFT and the
    other requests' prefills it waits for, as each pool's requests measured them at this batch
    (``PoolLoad.waits``), beside its own steps at the cost model's price. A decode step 1.18x faster bought
    a request at c=16 1.02x (code) where speculation's waits were longer than plain's. Unmeasured, or a
    plain choice: as it is."""
    if load.waits is None or choice.k == 0:
        return choice
    plain_waits, own_waits = load.waits
    plain_s = ctx.features.max_tokens * ctx.cost_models[topology].plain_time_per_token(load.decode_batch())
    plain = plain_waits.latency(plain_s)
    spec = own_waits.latency(plain_s / choice.predicted_speedup)
    return KChoice(choice.k, spec / ctx.features.max_tokens, plain / spec)


def spec_options(ctx: RoutingContext) -> list[_Option]:
    """Best K per available spec topology, over the batches the request can expect to decode in there,
    priced over the whole request (``whole_request``)."""
    options = []
    for t in SPEC_TOPOLOGIES:
        load = ctx.loads.get(t)
        if t in ctx.cost_models and load is not None and load.replicas > 0:
            options.append(_Option(t, load.decode_batch(), whole_request(ctx, t, load, _expected(ctx, t, load)),
                                   load.declined >= ctx.thresholds.declined_share))
    return options


def _regime(ctx: RoutingContext, best: _Option | None) -> str:
    if best is None:
        return "unknown"
    f, cm, a = ctx.features, ctx.cost_models[best.topology], ctx.acceptance
    no_hop = CostModel(replace(cm.costs, hop_overhead_s={best.topology: 0.0}))
    short = ctx.short_context_models.get(best.topology, cm)

    def whole(model: CostModel) -> float:  # at this batch, priced as ``best`` is: over the whole request
        choice = _best(ctx, best.topology, best.batch, a, model)
        return whole_request(ctx, best.topology, ctx.loads[best.topology], choice).predicted_speedup

    ev = RegimeEvidence(
        temperature=f.temperature,
        prompt_tokens=f.prompt_tokens,
        max_tokens=f.max_tokens,
        context_limit=ctx.context_limit,
        acceptance=a,
        evidence=ctx.evidence,
        cost_ratio=cm.cost_ratio(best.batch),
        speedup=best.choice.predicted_speedup,
        speedup_batch1=_best(ctx, best.topology, 1, a).predicted_speedup,
        speedup_no_hop=whole(no_hop),
        speedup_short_context=whole(short),
    )
    return classify_regime(ev, ctx.thresholds)


def _validate(ctx: RoutingContext) -> None:
    f = ctx.features
    if f.mode not in MODES or f.objective not in OBJECTIVES:
        raise RoutingError(f"mode must be one of {MODES}, objective one of {OBJECTIVES}")
    if f.k is not None and not 0 <= f.k <= ctx.k_max:
        raise RoutingError(f"k must be in [0, {ctx.k_max}], got {f.k}")
    if f.topology is not None and f.topology not in SPEC_TOPOLOGIES:
        raise RoutingError(f"topology must be one of {SPEC_TOPOLOGIES}, got {f.topology!r}")
    if f.mode == "plain" and (f.k or f.topology):
        raise RoutingError("mode 'plain' conflicts with a speculative k or topology")
    if f.k == 0 and (f.mode == "speculative" or f.topology):
        raise RoutingError("k = 0 means plain decoding; it conflicts with speculation")
    if f.prompt_tokens + f.max_tokens > ctx.context_limit:
        raise RoutingError(f"prompt + max_tokens exceeds the context limit {ctx.context_limit}")


def _plain(regime: str, reason: str) -> RoutingDecision:
    return RoutingDecision(PLAIN_POOL, None, 0, regime, 1.0, reason)


def _explicit_spec(ctx: RoutingContext, options: list[_Option]) -> RoutingDecision:
    f = ctx.features
    chosen = [o for o in options if f.topology in (None, o.topology)]
    if not chosen:
        raise RoutingError(f"no replicas for speculative topology {f.topology or SPEC_TOPOLOGIES}")
    opt = max(chosen, key=lambda o: o.choice.predicted_speedup)
    cm = ctx.cost_models[opt.topology]
    k = f.k or cm.best_k(opt.batch, ctx.acceptance, ctx.k_max, opt.topology, allow_plain=False).k
    speedup = cm.plain_time_per_token(opt.batch) / cm.spec_time_per_token(opt.batch, k, ctx.acceptance, opt.topology)
    return RoutingDecision(opt.topology, opt.topology, k, _regime(ctx, opt), speedup, "speculation requested")


def route(ctx: RoutingContext) -> RoutingDecision:
    _validate(ctx)
    f, th = ctx.features, ctx.thresholds
    options = spec_options(ctx)
    if f.mode == "speculative" or f.k or f.topology:
        return _explicit_spec(ctx, options)
    best = max(options, key=lambda o: o.choice.predicted_speedup, default=None)
    regime = _regime(ctx, best)
    if f.mode == "plain" or f.k == 0:
        return _plain(regime, "plain requested")
    if f.objective == "throughput":
        return _plain(regime, "throughput objective: plain batches wider")
    if best is None:
        return _plain(regime, "no speculative pool available")
    if regime == "prefill_heavy":
        return _plain(regime, "too few decode steps to amortise the draft")
    home = _home(ctx)
    paying = [o for o in options if o.choice.k > 0 and not o.declined
              and o.choice.predicted_speedup > 1.0 + th.margin + _split(ctx, home, o.topology)]
    stay = _stay(ctx, home, options)
    if stay is not None and not any(o.choice.predicted_speedup - _split(ctx, home, o.topology)
                                    > stay.choice.predicted_speedup for o in paying):
        return RoutingDecision(stay.topology, stay.topology, stay.choice.k, regime, stay.choice.predicted_speedup,
                               f"stays with the load on shared cores: K={stay.choice.k} at batch {stay.batch}, "
                               f"predicted {stay.choice.predicted_speedup:.2f}, a={ctx.acceptance:.2f}")
    if not paying:
        cm = ctx.cost_models[best.topology]
        stays = " (stays with the load on shared cores)" if home == PLAIN_POOL and \
            best.choice.predicted_speedup > 1.0 + th.margin else ""
        if best.declined:
            stays += f" ({best.topology}'s adaptive K ran such requests plain at this batch: " \
                     f"{ctx.loads[best.topology].declined:.0%} of their steps)"
        return _plain(regime, f"predicted speedup {best.choice.predicted_speedup:.2f} <= "
                              f"{1.0 + th.margin + _split(ctx, home, best.topology):.2f}{stays} "
                              f"(a={ctx.acceptance:.2f} on {ctx.evidence:.0f} judged tokens, "
                              f"c={cm.cost_ratio(best.batch):.2f}, batch {best.batch})")
    with_room = [o for o in paying if ctx.loads[o.topology].has_room()]
    if not with_room:
        return _plain(regime, "speculative pools full")
    opt = max(with_room, key=lambda o: o.choice.predicted_speedup - _split(ctx, home, o.topology))
    reason = f"K={opt.choice.k} at batch {opt.batch}, a={ctx.acceptance:.2f}"
    return RoutingDecision(opt.topology, opt.topology, opt.choice.k, regime, opt.choice.predicted_speedup, reason)


def _home(ctx: RoutingContext) -> str | None:
    """On shared cores, the pool that holds most of the load's rows (None: an idle load, or cores of their own).
    A probe in a speculative pool counts as the plain row routing made it (a probe runs where routing did
    not put it): counted where it ran, a probe that went first into an idle load drew the rest of a burst
    after it (measured on the tiny family: a third of a c=8 load followed probes into the co-located pool)."""
    rows = {p: load.active + load.queued - (load.probing if p != PLAIN_POOL else 0) for p, load in ctx.loads.items()}
    if PLAIN_POOL in rows:
        rows[PLAIN_POOL] += sum(load.probing for p, load in ctx.loads.items() if p != PLAIN_POOL)
    home = max(rows, key=rows.__getitem__, default=None)
    return home if ctx.shared_compute and home is not None and rows[home] else None


def _split(ctx: RoutingContext, home: str | None, pool: str) -> float:
    """What leaving the pool that holds the load must buy: measured here, auto splitting a c=8 load over
    the pools on 2 cores served 0.85-0.95x of either pool alone (two engines and the serving processes
    contend, where the cost model prices each pool as if it ran alone)."""
    return ctx.thresholds.split_margin if home is not None and pool != home else 0.0


def _stay(ctx: RoutingContext, home: str | None, options: list[_Option]) -> _Option | None:
    """The speculative pool that holds the load on shared cores, priced with K >= 1 for a request that
    joins it, where speculation there is within ``split_margin`` of plain (the replica's adaptive K goes
    down to K=0 where it does not pay); None where the load is not in a speculative pool, or it is full,
    or a budgeted pool would plan the request plain, or its adaptive K ran such requests plain.
    Priced over the whole request (``whole_request``), it must pay by the margin: what adaptive K undoes
    is a step's loss, not the waits of rows that finish apart (c=16, code: 224 of 384 auto requests
    stayed co-located at a whole price of 1.00-1.04, and auto's p99 TPOT was 1.40x plain's)."""
    opt = next((o for o in options if o.topology == home and ctx.loads[o.topology].has_room()), None)
    if opt is None or opt.declined or home in ctx.budgeted and opt.choice.k == 0:
        return None
    choice = opt.choice if opt.choice.k > 0 else whole_request(ctx, home, ctx.loads[home], ctx.cost_models[
        home].best_k(opt.batch, ctx.acceptance, ctx.k_max, home, allow_plain=False))
    tolerance = 0.0 if ctx.loads[home].waits is not None else ctx.thresholds.split_margin
    if choice.predicted_speedup <= 1.0 + ctx.thresholds.margin - tolerance:
        return None
    return replace(opt, choice=choice)
