"""Acceptance tracker: prior, bias correction for first-rejection steps, decay, snapshot."""

import json
import random

import pytest

from specdec_core.acceptance import (
    AcceptanceTracker,
    ProposalCoverage,
    TrafficClass,
    judged_positions,
    temperature_bucket,
)

CLS = TrafficClass.of("draft-1l", 0.0, "code")


def simulate_step(rng: random.Random, a: float, k: int) -> int:
    """Accepted count of one step: i.i.d. accepts with probability a, first rejection ends it."""
    n = 0
    while n < k and rng.random() < a:
        n += 1
    return n


def test_temperature_buckets():
    assert [temperature_bucket(t) for t in (0.0, 0.3, 0.5, 0.7, 1.0, 1.5)] == [
        "greedy", "low", "low", "mid", "mid", "high"]
    assert TrafficClass.of("d", 0.8).key() == "d/mid/default"
    with pytest.raises(ValueError):
        temperature_bucket(-0.1)


def test_prior_before_evidence():
    tr = AcceptanceTracker(prior_mean=0.6, prior_weight=20, draft_prior_means={"eagle": 0.8})
    assert tr.estimate(CLS) == pytest.approx(0.6)
    assert tr.estimate(TrafficClass.of("eagle", 1.0)) == pytest.approx(0.8)
    assert tr.evidence(CLS) == 0.0
    tr.observe(CLS, proposed=4, accepted=4)  # 4 judged, 4 accepted
    assert tr.estimate(CLS) == pytest.approx((0.6 * 20 + 4) / 24, rel=1e-3)
    assert tr.evidence(CLS) == pytest.approx(4, rel=1e-2)


def test_judged_positions_rule():
    assert judged_positions(4, 2) == [True, True, False]  # third judged and rejected, fourth never judged
    assert judged_positions(4, 4) == [True] * 4  # all accepted (bonus token follows)
    assert judged_positions(3, 0) == [False]
    with pytest.raises(ValueError):
        judged_positions(2, 3)


def test_estimate_is_unbiased_where_naive_ratio_is_low():
    rng = random.Random(0)
    tr = AcceptanceTracker(prior_weight=1, half_life_tokens=1e9)
    a, k = 0.8, 8
    proposed = accepted = 0
    for _ in range(4000):
        n = simulate_step(rng, a, k)
        tr.observe(CLS, k, n)
        proposed, accepted = proposed + k, accepted + n
    assert tr.estimate(CLS) == pytest.approx(a, abs=0.01)
    assert accepted / proposed == pytest.approx(0.416, abs=0.02)  # naive: biased low
    rates = tr.position_rates(CLS)
    assert len(rates) == k and all(r == pytest.approx(a, abs=0.03) for r in rates)


def test_per_position_all_judged():
    tr = AcceptanceTracker(prior_weight=1, half_life_tokens=1e9)
    tr.observe(CLS, 4, 1, per_position=[True, False, True, True])  # sampler judged every position
    assert tr.evidence(CLS) == pytest.approx(4)
    assert tr.estimate(CLS) == pytest.approx((0.6 + 3) / 5)
    with pytest.raises(ValueError):
        tr.observe(CLS, 4, 1, per_position=[True, True, True])  # position 1 must be the rejection
    with pytest.raises(ValueError):
        tr.observe(CLS, 4, 1, per_position=[True])  # the rejection was judged, so it must be listed


def test_decay_notices_a_traffic_shift():
    rng = random.Random(1)
    tr = AcceptanceTracker(prior_weight=20, half_life_tokens=200)
    for _ in range(500):
        tr.observe(CLS, 4, simulate_step(rng, 0.9, 4))
    assert tr.estimate(CLS) == pytest.approx(0.9, abs=0.03)
    judged = 0.0
    while judged < 3 * 200:  # three half-lives of the new traffic
        n = simulate_step(rng, 0.2, 4)
        tr.observe(CLS, 4, n)
        judged += len(judged_positions(4, n))
    assert tr.estimate(CLS) < 0.35
    assert tr.evidence(CLS) < 200 / 0.693 + 5  # bounded by the decay: ~ half-life / ln 2


def test_zero_k_steps_are_ignored_and_classes_are_separate():
    tr = AcceptanceTracker()
    tr.observe(CLS, 0, 0)
    assert tr.evidence(CLS) == 0.0
    other = TrafficClass.of("draft-1l", 1.2, "code")
    tr.observe(other, 4, 0)
    assert tr.evidence(CLS) == 0.0 and tr.evidence(other) > 0


def test_snapshot_is_json():
    tr = AcceptanceTracker()
    tr.observe(CLS, 3, 2)
    snap = json.loads(json.dumps(tr.snapshot()))
    (row,) = snap["classes"]
    assert row["draft"] == "draft-1l" and row["temperature_bucket"] == "greedy" and row["domain"] == "code"
    assert row["steps"] == 1 and len(row["per_position"]) == 3
    assert row["acceptance"] == pytest.approx(tr.estimate(CLS))


def test_observe_request_matches_stepwise_counts():
    """A finished request's aggregate per-position counts give the stepwise estimate (no decay)."""
    from specdec_core.stats import RequestStats

    steps = [(4, 4), (4, 1), (4, 0), (2, 2)]  # (K, accepted) per verify step
    stepwise = AcceptanceTracker(prior_weight=5, half_life_tokens=1e12)
    stats = RequestStats()
    for k, n in steps:
        stepwise.observe(CLS, k, n)
        stats.record_verify(k, n)
    d = stats.as_dict()
    agg = AcceptanceTracker(prior_weight=5, half_life_tokens=1e12)
    agg.observe_request(CLS, d["proposed_per_position"], d["accepted_per_position"], d["verify_steps"])
    assert agg.estimate(CLS) == pytest.approx(stepwise.estimate(CLS))
    assert agg.evidence(CLS) == pytest.approx(stepwise.evidence(CLS))
    assert agg.position_rates(CLS) == pytest.approx(stepwise.position_rates(CLS))
    agg.observe_request(CLS, [], [])  # a plain request judges nothing
    assert agg.evidence(CLS) == pytest.approx(stepwise.evidence(CLS))
    with pytest.raises(ValueError):
        agg.observe_request(CLS, [1], [2])


def test_time_decay_returns_a_silent_class_to_the_prior():
    """A class routed to plain decoding produces no evidence: with a clock its old counts halve every
    half_life_s, so the estimate drifts back to the prior instead of freezing at a stale value."""
    now = [0.0]
    tr = AcceptanceTracker(prior_mean=0.6, prior_weight=20, half_life_s=60.0, clock=lambda: now[0])
    cls = TrafficClass("d", "greedy", "code")
    tr.observe_request(cls, [400], [40])  # a = 0.1 on 400 judged tokens
    low = tr.estimate(cls)
    assert low < 0.15 and tr.evidence(cls) == pytest.approx(400)
    now[0] = 60.0
    assert tr.evidence(cls) == pytest.approx(200)
    assert tr.estimate(cls) == pytest.approx((0.6 * 20 + 20) / 220)
    now[0] = 600.0
    assert tr.estimate(cls) > 0.55  # ten half-lives: the prior again
    tr.observe_request(cls, [10], [9])  # fresh evidence counts in full
    assert tr.evidence(cls) == pytest.approx(10 + 400 / 2**10, rel=1e-3)
    without = AcceptanceTracker(prior_mean=0.6, prior_weight=20)
    without.observe_request(cls, [400], [40])
    assert without.estimate(cls) == pytest.approx(low)  # no clock: counts decay by tokens only
    with pytest.raises(ValueError):
        AcceptanceTracker(half_life_s=60.0)


def test_proposal_coverage_counts_what_came_back_of_what_was_asked():
    cover = ProposalCoverage()
    assert cover.rates(3) == [1.0, 1.0, 1.0]  # nothing seen: a proposer delivers what it is asked
    for _ in range(4):
        cover.record(4, 2)  # a lookup that matched two tokens
    cover.record(2, 0)  # and one that found no match
    assert cover.asked == [5, 5, 4, 4] and cover.offered == [4, 4, 0, 0]
    assert cover.rates(4, prior_weight=1.0) == pytest.approx([5 / 6, 5 / 6, 1 / 5, 1 / 5])
    assert cover.rates(6, prior_weight=0.0)[4:] == [0.0, 0.0]  # never asked that deep: no better than above
    cover = ProposalCoverage()
    cover.record(1, 0)
    cover.record(3, 3)
    assert cover.rates(3, prior_weight=0.0) == [0.5, 0.5, 0.5]  # 1.0 asked deeper, capped: never grows with depth
