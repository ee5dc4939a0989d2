"""Routing policy on synthetic cost models: one case per regime, explicit overrides, validation."""

from dataclasses import replace

import pytest

from autoscaling.routing import (
    PoolLoad,
    RequestFeatures,
    RoutingContext,
    RoutingError,
    route,
)
from specdec_core.costmodel import CostModel
from specdec_core.step_costs import StepCosts


def model(c: float = 0.1, hop: float = 0.0) -> CostModel:
    """Batch 1: memory bound, a 9-token verify costs 1.2 plain steps. Batch 64: compute bound,
    verify cost linear in tokens. Draft costs c plain steps at every batch."""
    return CostModel(
        StepCosts(
            batches=(1, 64),
            qs=(1, 9),
            target_s=((1.0, 1.2), (2.0, 18.0)),
            draft_s=(c, 2 * c),
            hop_overhead_s={"colocated": 0.0, "separate": hop},
        )
    )


def ctx(
    a: float = 0.8,
    c: float = 0.1,
    hop: float = 0.2,
    evidence: float = 1000.0,
    loads: dict | None = None,
    pools: tuple = ("colocated", "separate"),
    **features,
) -> RoutingContext:
    base = {"plain": PoolLoad(), "colocated": PoolLoad(), "separate": PoolLoad()}
    return RoutingContext(
        features=RequestFeatures(**{"temperature": 0.0, "max_tokens": 256, "prompt_tokens": 64, **features}),
        loads={**base, **(loads or {})},
        cost_models={t: model(c, hop) for t in pools},
        acceptance=a,
        evidence=evidence,
        context_limit=2048,
    )


def test_favorable_goes_speculative_colocated():
    d = route(ctx())
    assert (d.pool, d.topology, d.regime) == ("colocated", "colocated", "favorable")
    assert d.k > 0 and d.predicted_speedup > 1.05


def test_large_batch_goes_plain():
    d = route(ctx(loads={"colocated": PoolLoad(active=63), "separate": PoolLoad(active=63)}))
    assert (d.pool, d.k, d.regime) == ("plain", 0, "large_batch")


def test_high_entropy_and_domain_mismatch():
    hot = route(ctx(a=0.1, temperature=1.2))
    cold = route(ctx(a=0.1, temperature=0.0))
    assert (hot.pool, hot.regime) == ("plain", "high_entropy")
    assert (cold.pool, cold.regime) == ("plain", "domain_mismatch")
    # a low acceptance that is still the prior is not blamed on the traffic
    assert route(ctx(a=0.1, temperature=1.2, evidence=5)).regime not in ("high_entropy", "domain_mismatch")


def test_expensive_draft():
    d = route(ctx(a=0.8, c=0.9))
    assert (d.pool, d.regime) == ("plain", "expensive_draft")


def test_orchestration_overhead_when_only_separate():
    d = route(ctx(hop=3.0, pools=("separate",)))  # hops cost 3 plain steps
    assert (d.pool, d.regime) == ("plain", "orchestration_overhead")
    both = route(ctx(hop=3.0))
    assert (both.pool, both.regime) == ("colocated", "favorable")


def test_prefill_heavy_goes_plain_even_when_favorable():
    assert route(ctx(max_tokens=8)).regime == "prefill_heavy"
    d = route(ctx(max_tokens=32, prompt_tokens=1000))
    assert (d.pool, d.regime) == ("plain", "prefill_heavy")


def test_no_gain():
    # a = 0.5, c = 0.45: pays nowhere, acceptance not low, draft not expensive
    d = route(ctx(a=0.5, c=0.45))
    assert d.regime == "no_gain" and "a=0.50" in d.reason and "c=0.45" in d.reason, d


def context_ctx(slopes: tuple[float, float], prompt_tokens: int, active: int) -> RoutingContext:
    """``model()``'s grid with per-row context slopes (seconds per cached token at q = 1 and 9),
    priced at the prompt's context and at the calibration's (64)."""
    costs = StepCosts(batches=(1, 64), qs=(1, 9), target_s=((1.0, 1.2), (2.0, 18.0)), draft_s=(0.1, 0.2),
                      hop_overhead_s={"colocated": 0.0, "separate": 0.2}, context_len=64, context_slope_s=slopes)
    loads = {"plain": PoolLoad(), "colocated": PoolLoad(active=active)}
    return RoutingContext(
        features=RequestFeatures(temperature=0.0, max_tokens=512, prompt_tokens=prompt_tokens),
        loads=loads, cost_models={"colocated": CostModel(costs.at_context(prompt_tokens))},
        short_context_models={"colocated": CostModel(costs)}, acceptance=0.8, evidence=1000.0, context_limit=4096)


def test_long_context_decides_either_way():
    """Where the KV read dominates a step (a slope the same at every verify width: a GPU's), a long
    context makes a batch-64 verify nearly free: the batch that goes plain at a short context goes
    speculative at a long one. Where attention is compute bound (a slope linear in the width: this
    CPU's), a long context makes the batch-1 verify dear: speculative short, plain long. The label
    names the context both times."""
    read_bound, compute_bound = (1e-4, 1e-4), (1e-3, 9e-3)
    assert route(context_ctx(read_bound, 100, active=63)).regime == "large_batch"
    d = route(context_ctx(read_bound, 3000, active=63))
    assert (d.pool, d.regime) == ("colocated", "long_context") and d.k > 0
    assert route(context_ctx(compute_bound, 100, active=0)).regime == "favorable"
    d = route(context_ctx(compute_bound, 3000, active=0))
    assert (d.pool, d.regime) == ("plain", "long_context")


def test_throughput_objective_goes_plain():
    d = route(ctx(objective="throughput"))
    assert (d.pool, d.k, d.regime) == ("plain", 0, "favorable")


def test_full_pool_falls_back():
    full = PoolLoad(active=4, capacity=4)
    d = route(ctx(loads={"colocated": full}))
    assert d.pool == "separate"  # still pays with its hops
    d = route(ctx(loads={"colocated": full, "separate": full}))
    assert (d.pool, d.regime) == ("plain", "favorable") and "full" in d.reason


def test_no_spec_pool():
    d = route(ctx(pools=()))
    assert (d.pool, d.regime) == ("plain", "unknown")
    d = route(ctx(loads={"colocated": PoolLoad(replicas=0), "separate": PoolLoad(replicas=0)}))
    assert d.pool == "plain"


def test_joined_batch_spreads_over_replicas():
    assert PoolLoad(active=6, queued=1, replicas=2).joined_batch() == 4
    assert PoolLoad().joined_batch() == 1
    assert not PoolLoad(active=3, queued=1, capacity=4).has_room()


def test_explicit_fields_win():
    assert route(ctx(mode="plain")).pool == "plain"
    assert route(ctx(k=0)).pool == "plain"
    d = route(ctx(k=3))
    assert (d.pool, d.k) == ("colocated", 3)
    d = route(ctx(topology="separate"))
    assert d.pool == "separate" and d.k >= 1
    d = route(ctx(a=0.8, c=0.9, mode="speculative"))  # the user insists: serve it, report the loss
    assert d.pool == "colocated" and d.k >= 1 and d.predicted_speedup < 1 and d.regime == "expensive_draft"


@pytest.mark.parametrize(
    "bad",
    [
        {"k": 20},
        {"topology": "teleport"},
        {"mode": "fast"},
        {"objective": "cheap"},
        {"mode": "plain", "k": 2},
        {"mode": "speculative", "k": 0},
        {"prompt_tokens": 2000, "max_tokens": 100},
    ],
)
def test_invalid_requests(bad):
    with pytest.raises(RoutingError):
        route(ctx(**bad))


def test_unavailable_topology_requested():
    with pytest.raises(RoutingError):
        route(ctx(topology="separate", pools=("colocated",)))


def _shared(a: float, rows: dict, shared: bool = True) -> RoutingContext:
    """Pools on one set of cores: each pool's rows, and the other pools' beside them."""
    rows = {"plain": 0, "colocated": 0, **rows}
    total = sum(rows.values())
    return RoutingContext(features=RequestFeatures(temperature=0.0, max_tokens=256, prompt_tokens=64),
                          loads={p: PoolLoad(active=r, beside=total - r) for p, r in rows.items()},
                          cost_models={"colocated": model()}, acceptance=a, evidence=1000.0, context_limit=2048,
                          shared_compute=shared)


def _acceptance_priced(lo: float, hi: float, batch: int = 6) -> float:
    """An acceptance at which the co-located pool's best K >= 1 at ``batch`` is predicted in (lo, hi)."""
    return next(a / 100 for a in range(5, 100)
                if lo < model().best_k(batch, a / 100, 8, "colocated", allow_plain=False).predicted_speedup < hi)


def test_on_shared_cores_a_request_stays_with_the_load_unless_leaving_clearly_pays():
    """Five rows decode on shared cores; the next request is priced at the whole load's batch (6).
    Near break-even it joins the pool that holds the load (a split makes two engines contend: measured
    0.85-0.95x of either pool alone), and leaves it only for ``split_margin`` more."""
    marginal = _acceptance_priced(1.06, 1.14)  # pays by the margin, not by the split margin
    d = route(_shared(marginal, {"plain": 5}))
    assert d.pool == "plain" and "stays with the load" in d.reason, d
    assert route(_shared(marginal, {"colocated": 5})).pool == "colocated"
    assert route(_shared(marginal, {"plain": 5}, shared=False)).pool == "colocated"  # cores of their own
    losing = _acceptance_priced(0.96, 1.04)  # within the split margin of plain: stays speculative
    d = route(_shared(losing, {"colocated": 5}))
    assert d.pool == "colocated" and d.k > 0 and "stays with the load" in d.reason, d
    assert route(_shared(losing, {"plain": 5})).pool == "plain"
    assert route(_shared(_acceptance_priced(0.5, 0.9), {"colocated": 5})).pool == "plain"  # clearly loses: leaves
    assert route(_shared(_acceptance_priced(1.3, 9.0), {"plain": 5})).pool == "colocated"  # clearly pays: leaves
    assert route(_shared(marginal, {})).pool == "colocated"  # an idle load has no pool to stay with
    probed = _shared(marginal, {"colocated": 5})  # the co-located rows are probes of plain requests:
    probed = replace(probed, loads={**probed.loads, "colocated": replace(probed.loads["colocated"], probing=5)})
    assert route(probed).pool == "plain"  # the load's pool is plain, as routing made them


def _burst_ctx(joining_shares: tuple[tuple[int, float], ...], joining: float | None = None) -> RoutingContext:
    """An idle load on shared cores, where the separate pool is the faster one for a lone request (7% at
    batch 1, as measured at c=1 on the memory-bound family: its overlap has a core to itself) and the
    slower one once rows join it (18% at batch 4: none is free)."""
    separate = CostModel(StepCosts(
        batches=(1, 2, 4, 64), qs=(1, 9),
        target_s=((1.0, 1.1), (1 + 1 / 63, 1.2), (1 + 3 / 63, 3.0), (2.0, 40.0)),  # plain: model()'s
        draft_s=(0.1, 0.1, 0.1, 0.2), hop_overhead_s={"colocated": 0.0, "separate": 0.0}))
    mean = sum(rows * share for rows, share in joining_shares) if joining is None else joining
    load = PoolLoad(joining=mean, joining_shares=joining_shares)
    return RoutingContext(features=RequestFeatures(temperature=0.0, max_tokens=256, prompt_tokens=64),
                          loads={"plain": load, "colocated": load, "separate": load},
                          cost_models={"colocated": model(), "separate": separate}, acceptance=0.8,
                          evidence=1000.0, context_limit=2048, shared_compute=True)


def test_a_request_that_may_open_a_burst_is_priced_over_the_batches_it_may_decode_in():
    """Half the requests that joined an idle load saw three rows join them (a burst opened), half none
    (a drain ended). Their mean, 1.5 rows, prices batch 2, where the separate pool is fastest; over the
    two outcomes (batch 1 or 4, by time per token) the co-located pool is. The predicted speedup is the
    expected plain time over the expected speculative time."""
    assert route(_burst_ctx(((0, 1.0),))).pool == "separate"  # every such request ran alone
    assert route(_burst_ctx((), joining=1.5)).pool == "separate"  # the mean alone: batch 2
    burst = _burst_ctx(((0, 0.5), (3, 0.5)))
    d = route(burst)
    assert d.pool == "colocated", d
    co = model()
    alone, joined = co.best_k(1, 0.8, 8), co.best_k(4, 0.8, 8)
    plain = 0.5 * co.plain_time_per_token(1) + 0.5 * co.plain_time_per_token(4)
    spec = 0.5 * alone.time_per_token_s + 0.5 * joined.time_per_token_s
    assert d.predicted_speedup == pytest.approx(plain / spec)
    assert d.k in (alone.k, joined.k)


def test_the_batches_a_request_may_decode_in_are_priced_by_power_of_two():
    """Outcomes in one power of two price once, at their shares' mean batch: a price per outcome cost a
    budgeted pool 5 ms a request at 16 outcomes."""
    load = PoolLoad(joining_shares=((0, 0.5), (3, 0.2), (5, 0.3)))  # batches 1, 4 and 6
    assert load.decode_batches() == ((1, 0.5), (5, pytest.approx(0.5)))  # 4 and 6 at (0.2*4 + 0.3*6) / 0.5
    wide = PoolLoad(joining_shares=tuple((rows, 1 / 16) for rows in range(16)))  # batches 1..16
    assert [b for b, _ in wide.decode_batches()] == [1, 2, 6, 12, 16]


def test_a_request_is_priced_over_its_whole_latency_where_both_pools_measured_their_waits():
    """At batch 21 a K=1 step makes a decode 1.13x faster than plain's. With the TTFT and the prefill waits
    each pool's requests measured there (in proportion, c=16 on code: plain 1.08 s TTFT for 3.45 s of steps
    and 1% more in others' prefills; co-located 0.50 s and 34%), the request is no faster: it goes plain."""
    from autoscaling.routing import RequestWaits

    load = PoolLoad(active=20)
    decode_only = route(ctx(loads={"colocated": load}, pools=("colocated",)))
    assert decode_only.pool == "colocated" and decode_only.predicted_speedup == pytest.approx(1.129, abs=0.01)
    plain_s = 256 * model().plain_time_per_token(load.decode_batch())  # the request's steps, plain
    plain, colocated = RequestWaits(0.313 * plain_s, 0.01), RequestWaits(0.145 * plain_s, 0.34)
    d = route(ctx(loads={"colocated": replace(load, waits=(plain, colocated))}, pools=("colocated",)))
    assert (d.pool, d.regime) == ("plain", "large_batch"), d
    whole = (0.313 + 1.01) / (0.145 + 1.34 / decode_only.predicted_speedup)
    assert f"predicted speedup {whole:.2f}" in d.reason and whole < 1.0
    # the same waits as plain's dilute the decode's gain (Amdahl) and leave the choice as it was
    same = route(ctx(loads={"colocated": replace(load, waits=(plain, plain))}, pools=("colocated",)))
    assert same.pool == "colocated" and same.predicted_speedup == pytest.approx(
        (0.313 + 1.01) / (0.313 + 1.01 / decode_only.predicted_speedup))


def test_on_shared_cores_a_load_stays_speculative_on_a_whole_request_price_only_where_it_pays():
    """Within ``split_margin`` of plain on its decode steps the load stays speculative (adaptive K runs a
    losing step plain); priced over the whole request with the same price, it leaves for plain: the waits
    of rows that finish apart are no step adaptive K can undo."""
    from autoscaling.routing import RequestWaits

    losing = _acceptance_priced(0.97, 1.04)
    decode_only = _shared(losing, {"colocated": 5})
    assert route(decode_only).pool == "colocated"
    same = RequestWaits(0.0, 0.0)  # waits alike: the whole request's price is the steps'
    home = replace(decode_only.loads["colocated"], waits=(same, same))
    d = route(replace(decode_only, loads={**decode_only.loads, "colocated": home}))
    assert d.pool == "plain" and 0.97 < float(d.reason.split()[2]) < 1.04, d
