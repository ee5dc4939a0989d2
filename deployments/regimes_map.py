"""The live regime map (``GET /v1/regimes``, README): what the router knows, per traffic class, read
out of a ``RouteState`` (no Ray here). Per class: its acceptance estimate and evidence, the cost ratio
c at batch 1, the best K at batch 1 and the batch from which speculation stops paying (Leviathan et al.
2023: a speedup needs a > c), the same along the context, and the choice routing would make for a
batch-1 latency request of the class; plus the costs, their served drift, the pools' loads and what
the pools' adaptive K declined.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import TYPE_CHECKING

from autoscaling.routing import Pool, PoolLoad, RequestFeatures, break_even_batch, price, route
from specdec_core.acceptance import TEMPERATURE_BUCKETS, TrafficClass
from specdec_core.costmodel import CostModel

if TYPE_CHECKING:
    from deployments.route_state import RouteState

# A representative temperature per bucket, for the choice of a class.
BUCKET_TEMPERATURE = {"greedy": 0.0, "low": 0.3, "mid": 0.8, "high": 1.5}


def regimes_map(state: RouteState, loads: Mapping[str, PoolLoad]) -> dict:
    """The map for the pools' live ``loads``: per class, then the costs, loads and declined lessons."""
    snap = state.tracker.snapshot()
    classes = {(c["draft"], c["temperature_bucket"], c["domain"]): c for c in snap["classes"]}
    greedy = (state.draft_name, "greedy", "default")
    classes.setdefault(greedy, {"draft": greedy[0], "temperature_bucket": "greedy", "domain": "default",
                                "acceptance": state.tracker.estimate(TrafficClass(*greedy)), "evidence": 0.0,
                                "steps": 0, "per_position": []})
    idle = {p: dataclasses.replace(load, active=0, queued=0) for p, load in loads.items()}
    out = []
    for key in sorted(classes, key=lambda k: (k[0], TEMPERATURE_BUCKETS.index(k[1]), k[2])):
        c = dict(classes[key])
        cls = TrafficClass(*key)
        cm = state.view.model_for(cls)
        a = c["acceptance"]
        feats = RequestFeatures(temperature=BUCKET_TEMPERATURE[cls.temperature_bucket], max_tokens=256,
                                traffic_class=cls)
        choice = route(state.context(feats, idle)) if idle else None
        c.update({
            "cost_ratio_batch1": cm.cost_ratio(1),
            **_batch1(state, cm, a),
            "by_context": _context_axis(state, cls, a),
            "choice": None if choice is None else {
                "pool": choice.pool, "topology": choice.topology, "k": choice.k, "regime": choice.regime,
                "predicted_speedup": choice.predicted_speedup, "reason": choice.reason},
        })
        out.append(c)
    return {
        "draft": state.draft_name,
        "costs": {"source": state.costs_source, "calibrated": state.calibrated,
                  "hop_overhead_s": dict(state.costs.hop_overhead_s), "batches": list(state.costs.batches),
                  # served / calibrated step time per batch bucket (log2), learnt from finished requests
                  "drift": {b: dataclasses.asdict(d) for b, d in state.drift.buckets.items()}},
        "k_max": state.k_max,
        # (a pool's ``declined`` is per class: the list below)
        "pools": {p: {k: v for k, v in dataclasses.asdict(load).items() if k not in ("declined", "waits")}
                  for p, load in state.priced_loads(loads).items()},
        # what each pool's requests waited for besides their own steps, by batch bucket (``LoadLessons.waits``):
        # the whole request's price (``routing.whole_request``)
        "waits": [{"pool": pool, "batch_bucket": bucket, "ttft_s": ttft, "prefill_wait_ratio": ratio,
                   "requests": n} for pool, bucket, ttft, ratio, n in state.lessons.waits_lessons()],
        # what the pools' adaptive K declined: share of steps run plain, by pool, batch bucket and class
        "declined": [{"pool": pool, "batch_bucket": bucket, "class": dataclasses.asdict(cls) if cls else None,
                      "share": share, "learnt_s_ago": round(age, 3)}
                     for pool, bucket, cls, share, age in state.lessons.declined_lessons()],
        "shared_compute": state.shared_compute,
        "classes": out,
    }


def _context_axis(state: RouteState, cls: TrafficClass, a: float) -> list[dict]:
    """The class's regime along the context: at each context (powers of two up to the limit), the best K
    at batch 1, its predicted speedup, and the batch from which it stops paying."""
    axis = []
    context = 128
    while context < state.context_limit:
        axis.append({"context": context, **_batch1(state, state.view.model_for(cls, context), a)})
        context *= 2
    return axis


def _batch1(state: RouteState, cm: CostModel, a: float) -> dict:
    """The co-located pool's best speculation at batch 1, and the batch from which it stops paying (None:
    never in the calibrated range; 1: not even at batch 1), priced as routing prices it."""
    budgeted = Pool.COLOCATED in state.budgeted
    best = price(cm, Pool.COLOCATED, 1, a, state.k_max, budgeted)
    return {"best_k_batch1": best.k, "predicted_speedup_batch1": best.predicted_speedup,
            "break_even_batch": break_even_batch(cm, Pool.COLOCATED, a, best.k, state.k_max, budgeted)
            if best.k > 0 else 1}
