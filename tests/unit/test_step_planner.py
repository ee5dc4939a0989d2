"""The budgeted step planner: each row's K for the batch as a whole, priced as one ragged verify."""

import dataclasses
import itertools

import pytest

from specdec_core.acceptance import ProposalCoverage, position_rates
from specdec_core.costmodel import CostModel
from specdec_core.step_costs import StepCosts
from specdec_core.step_planner import BUDGET_MARGIN, budgeted_choice, plan_step, survival

# Shaped like the served family on this CPU (ms): a verify nearly free at batch 1, compute bound from
# ~16 tokens per forward (batch 8: 5 tokens a row cost 2.7x a plain step), a cheap draft.
COSTS = StepCosts(
    batches=(1, 8, 64),
    qs=(1, 2, 3, 5, 9),
    target_s=((0.0100, 0.0102, 0.0104, 0.0108, 0.0116),
              (0.0140, 0.0200, 0.0260, 0.0380, 0.0620),
              (0.0600, 0.1200, 0.1800, 0.3000, 0.5400)),
    draft_s=(0.0010, 0.0015, 0.0060),
)
MODEL = CostModel(COSTS)
HIGH, LOW = survival([0.9] * 8), survival([0.2] * 8)


def tokens_per_s(ks, survivals, model: CostModel = MODEL) -> float:
    expected = len(ks) + sum(sum(s[:k]) for s, k in zip(survivals, ks))
    return expected / model.ragged_step_time(len(ks), list(ks))


def test_survival_is_the_product_of_position_rates():
    assert survival([0.8, 0.5, 0.5]) == pytest.approx((0.8, 0.4, 0.2))


def test_a_rows_position_rates_shrink_towards_its_class():
    # 10 judged at position 1, 9 accepted; nothing judged at 2: the class's rate there.
    assert position_rates([9], [10], [0.5, 0.4], prior_weight=10) == pytest.approx([0.7, 0.4])


def test_one_row_speculates_deep_where_the_verify_is_free():
    plan = plan_step(MODEL, [HIGH], [None])
    assert plan.ks == (8,)
    assert plan.predicted_speedup > 3


def test_a_uniform_batch_gets_the_uniform_optimum():
    """Rows alike: the plan is at least as fast as the best K shared by every row."""
    for batch in (1, 8):
        plan = plan_step(MODEL, [HIGH] * batch, [None] * batch)
        best_uniform = max(tokens_per_s([k] * batch, [HIGH] * batch) for k in range(9))
        assert tokens_per_s(plan.ks, [HIGH] * batch) >= 0.999 * best_uniform


def test_a_mixed_batch_speculates_only_where_it_pays():
    """Half the rows accept 90%, half 20%: one K for all cannot beat plain by much; a K per row can."""
    survivals = [HIGH, LOW] * 4
    plan = plan_step(MODEL, survivals, [None] * 8)
    assert all(k > 0 for k in plan.ks[::2]) and all(k == 0 for k in plan.ks[1::2])
    best_uniform = max(tokens_per_s([k] * 8, survivals) for k in range(9))
    assert tokens_per_s(plan.ks, survivals) > 1.1 * best_uniform
    assert plan.predicted_speedup == pytest.approx(tokens_per_s(plan.ks, survivals) * COSTS.target_time(8, 1) / 8)


def test_the_plan_is_near_the_best_of_every_k_vector():
    survivals = [survival([0.95, 0.9, 0.6]), survival([0.7, 0.5, 0.3]), survival([0.3, 0.2, 0.1])]
    plan = plan_step(MODEL, survivals, [None] * 3, margin=0.0)
    best = max(tokens_per_s(list(ks), survivals) for ks in itertools.product(range(4), repeat=3))
    assert tokens_per_s(plan.ks, survivals) >= 0.98 * best


def test_the_plan_is_the_best_k_vector_where_a_draft_forward_costs_a_fifth_of_a_step():
    """The memory-bound family at batch 2 (ms): a verify nearly free, a draft forward ~0.2 of a step, a
    packed verify ~0.9 ms more. Admission by survival alone deepens the best row before it starts the
    next, and a second draft forward cost more than it bought: rows at ~0.6 and ~0.79 ran (0, 1), never
    priced (1, 1), and measured 0.74x of it."""
    costs = StepCosts(batches=(1, 2, 4), qs=(1, 2, 3, 5, 9),
                      target_s=((0.0110, 0.0112, 0.0114, 0.0120, 0.0135),
                                (0.0113, 0.0118, 0.0121, 0.0144, 0.0180),
                                (0.0120, 0.0130, 0.0140, 0.0175, 0.0260)),
                      draft_s=(0.0024, 0.0025, 0.0039), ragged_s=(0.0, 0.0009, 0.0010))
    model = CostModel(costs)
    rates = (0.3, 0.5, 0.6, 0.8, 0.9, 0.95)
    for batch in (2, 3):
        for row_rates in itertools.combinations_with_replacement(rates, batch):
            survivals = [survival([a, a * 0.9, a * 0.8, a * 0.7]) for a in row_rates]
            plan = plan_step(model, survivals, [None] * batch, margin=0.0)
            best = max(itertools.product(range(5), repeat=batch),
                       key=lambda ks: tokens_per_s(ks, survivals, model))
            assert tokens_per_s(plan.ks, survivals, model) >= 0.995 * tokens_per_s(best, survivals, model), \
                (row_rates, plan.ks, best)


def test_a_compute_bound_batch_decodes_plain():
    plan = plan_step(MODEL, [survival([0.6] * 8)] * 64, [None] * 64)
    assert plan.ks == (0,) * 64
    assert plan.predicted_speedup == pytest.approx(1.0)


def test_the_routers_price_of_a_budgeted_pool_is_the_plan_of_a_uniform_batch():
    """What the router expects of a pool that plans its steps: the plan of ``batch`` rows like the
    request (K its widest row's, speedup the step's), plain where the plan is."""
    for batch in (1, 8, 64):
        plan = plan_step(MODEL, [survival([0.8] * 8)] * batch, [None] * batch)
        choice = budgeted_choice(MODEL, batch, [0.8] * 8)
        assert choice.k == max(plan.ks)
        assert choice.predicted_speedup == pytest.approx(plan.predicted_speedup if choice.k else 1.0)
    assert budgeted_choice(MODEL, 1, [0.8] * 8).k >= 2 and budgeted_choice(MODEL, 64, [0.8] * 8).k == 0
    assert budgeted_choice(MODEL, 1, [0.8] * 2).k <= 2  # the rates cap K


def test_speculation_must_beat_plain_by_the_margin():
    survivals = [survival([0.3] * 4)]
    free = plan_step(MODEL, survivals, [None], margin=0.0)
    gain = free.predicted_speedup
    assert any(free.ks) and 1.0 < gain < 1.3
    assert plan_step(MODEL, survivals, [None], margin=gain - 1 + 0.01).ks == (0,)


def test_rows_with_their_own_k_are_planned_around():
    plan = plan_step(MODEL, [(), HIGH, LOW], [3, None, 0])
    assert plan.ks[0] == 3 and plan.ks[2] == 0 and plan.ks[1] > 0


def test_the_incremental_price_is_the_ragged_step_time():
    survivals = [HIGH, survival([0.6] * 8), LOW, survival([0.8] * 5)]
    plan = plan_step(MODEL, survivals, [None] * 4, margin=0.0)
    assert plan.step_s == pytest.approx(MODEL.ragged_step_time(4, plan.ks))
    # Uniform K: the ragged price is the padded one.
    assert MODEL.ragged_step_time(8, [4] * 8) == pytest.approx(MODEL.spec_step_time(8, 4))


def _policy(prior_mean: float):
    from specdec_core import AcceptanceTracker, AdaptiveK, TrafficClass
    from specdec_core.cost_view import CostView

    policy = AdaptiveK(CostView(COSTS), AcceptanceTracker(prior_mean=prior_mean), "draft", budgeted=True)
    return policy, TrafficClass.of("draft", 0.0)


def test_a_class_without_evidence_probes_then_follows_what_it_learns():
    """At batch 8 a row priced at a prior of 0.3 would stay plain, but a class nobody has judged is
    probed (one draft token); once the class shows 90% acceptance its rows speculate deep, and once it
    shows 3% they stay plain until ``probe_every`` plain steps make a probe due."""
    policy, cls = _policy(prior_mean=0.3)
    rows = dict(classes=[cls] * 8, evidence=[([], [], None)] * 8, k_maxes=[8] * 8, fixed=[None] * 8,
                context_len=64, catch_up=[1] * 8, remaining=[32] * 8)
    assert policy.plan_budget(**rows, plain_runs=[0] * 8).ks == (1,) * 8
    for _ in range(40):
        policy.observe(cls, 8, 8)
    assert min(policy.plan_budget(**rows, plain_runs=[0] * 8).ks) >= 4
    policy, cls = _policy(prior_mean=0.3)
    for _ in range(200):
        policy.observe(cls, 1, 0)
    assert policy.plan_budget(**rows, plain_runs=[0] * 8).ks == (0,) * 8
    assert policy.plan_budget(**rows, plain_runs=[policy.probe_every] * 8).ks == (1,) * 8


def test_a_batch_probes_where_speculation_would_pay_were_acceptance_back():
    """A probe asks whether speculation would pay were acceptance back, as the per-request path does, not
    whether one draft token pays this step. With a draft step of 6 ms, one token on each of 4 unexplored
    rows does not beat the plan's margin, but deep drafts at the ceiling would: the rows probe. A draft
    so slow that nothing at the ceiling pays leaves the batch plain."""
    from specdec_core import AcceptanceTracker, AdaptiveK, TrafficClass
    from specdec_core.cost_view import CostView
    from specdec_core.costmodel import PROBE_CEILING

    rows = dict(classes=[TrafficClass.of("draft", 0.0)] * 4, evidence=[([], [], None)] * 4, k_maxes=[8] * 4,
                fixed=[None] * 4, context_len=64, plain_runs=[0] * 4, catch_up=[1] * 4, remaining=[32] * 4)
    for draft_step_s, probes in ((0.006, True), (0.05, False)):
        costs = dataclasses.replace(COSTS, draft_step_s=(draft_step_s,) * len(COSTS.batches))
        policy = AdaptiveK(CostView(costs), AcceptanceTracker(prior_mean=0.3), "draft", budgeted=True)
        one_token = plan_step(CostModel(costs), [(PROBE_CEILING,)] * 4, [None] * 4)
        assert one_token.ks == (0,) * 4  # what the probe was priced at before
        assert policy.plan_budget(**rows).ks == ((1,) * 4 if probes else (0,) * 4)


def test_a_due_probe_waits_while_its_drafts_catch_up_costs_more_than_it_may_save():
    """As per request (``AdaptiveK._probe_affordable``): a row plain long enough for a probe, its draft
    400 tokens behind with 64 tokens left, stays plain (its catch-up spread over what is left would have
    priced it in); a few tokens behind, it probes."""
    from dataclasses import replace

    from specdec_core import AcceptanceTracker, AdaptiveK, TrafficClass
    from specdec_core.cost_view import CostView

    costs = replace(COSTS, draft_prefill_s_per_token=3e-5)
    policy = AdaptiveK(CostView(costs), AcceptanceTracker(prior_mean=0.3), "draft", budgeted=True)
    cls = TrafficClass.of("draft", 0.0)
    for _ in range(200):
        policy.observe(cls, 1, 0)
    rows = dict(classes=[cls] * 8, evidence=[([], [], None)] * 8, k_maxes=[8] * 8, fixed=[None] * 8,
                context_len=64, plain_runs=[policy.probe_every] * 8, remaining=[64] * 8)
    assert policy.plan_budget(**rows, catch_up=[2] * 8).ks == (1,) * 8
    assert policy.plan_budget(**rows, catch_up=[400] * 8).ks == (0,) * 8


def test_a_rows_own_evidence_sets_its_k():
    policy, cls = _policy(prior_mean=0.6)
    for _ in range(40):
        policy.observe(cls, 4, 2)
    good = ([30, 30, 30, 30], [30, 30, 30, 30], None)  # accepted, judged per position: every draft kept
    bad = ([0], [30], None)
    plan = policy.plan_budget([cls] * 8, [good, bad] * 4, [8] * 8, [None] * 8, 64, [0] * 8, [1] * 8, [32] * 8)
    assert all(k >= 2 for k in plan.ks[::2]) and all(k == 0 for k in plan.ks[1::2])


def test_a_row_the_draft_is_behind_on_pays_for_its_catch_up():
    """Two rows alike; the draft has to catch up on one of them first (its prompt): a start cost that
    eats that row's gain keeps it plain while the other speculates."""
    plan = plan_step(MODEL, [HIGH, HIGH], [None, None], start_s=[0.05, 0.0])
    assert plan.ks[0] == 0 and plan.ks[1] > 0
    assert plan_step(MODEL, [HIGH, HIGH], [None, None], start_s=[0.0, 0.0]).ks[0] > 0


def test_a_row_whose_proposer_falls_short_is_planned_shallower():
    """Two rows with the same acceptance where proposed; one's lookup has come back empty for most of
    what it asked beyond its second token: the positions it does not propose yield nothing, so the plan
    asks it for less (and a proposer that delivers everything is planned as before)."""
    policy, cls = _policy(prior_mean=0.6)
    for _ in range(40):
        policy.observe(cls, 4, 4)
    full, short = ProposalCoverage(), ProposalCoverage()
    for _ in range(20):
        full.record(8, 8)
        short.record(8, 2)
    evidence = [([20] * 8, [20] * 8, None)] * 2  # every proposed token accepted
    args = ([cls] * 2, evidence, [8] * 2, [None] * 2, 64, [0] * 2, [1] * 2, [32] * 2)
    plan = policy.plan_budget(*args, coverages=[full, short])
    assert plan.ks[1] < plan.ks[0]
    assert policy.plan_budget(*args, coverages=[full, full]) == policy.plan_budget(*args)  # a draft model's plan


def test_a_position_proposed_half_the_time_costs_half_its_verify_token():
    """An expected verify token below the staircase's first step is that share of the step, and the
    plan prices a lookup's positions at how often it delivers them: a row whose lookup proposes half
    of what it is asked costs less than a draft-model row at the same K (its yield, the survival it is
    given, is the caller's)."""
    costs = dataclasses.replace(COSTS, one_extra_s=(0.0101, 0.0145, 0.0700), draft_s=(0.0, 0.0, 0.0))  # a lookup
    assert costs.ragged_target_time(8, 0.5) == pytest.approx((0.0140 + 0.0145) / 2)
    assert costs.ragged_target_time(8, 1.0) == pytest.approx(0.0145)
    model = CostModel(costs)
    rows, fixed = [HIGH] + [()] * 7, [None] + [0] * 7
    full = plan_step(model, rows, fixed, margin=0.0)
    half_yield = tuple(0.5 * x for x in HIGH)  # the survival of asks proposed half the time
    half = plan_step(model, [half_yield] + [()] * 7, fixed, margin=0.0, coverage=[[0.5] * 8] + [[]] * 7)
    assert full.ks[0] >= 1 and half.ks[0] >= 1
    assert half.step_s < model.ragged_step_time(8, list(half.ks))  # priced below the full verify of its K
    assert half.expected_tokens == pytest.approx(8 + 0.5 * sum(HIGH[:half.ks[0]]))  # and yields half as often
    assert full.expected_tokens == pytest.approx(8 + sum(HIGH[:full.ks[0]]))


def test_deep_plans_are_priced_by_how_deep_steps_ran():
    """At batch 8 the plan goes deep for rows that accept 90%; once steps of depth 3-4 and beyond have
    measured 1.5x their price while K<=2 steps ran as priced, the same rows plan no deeper than 2."""
    from specdec_core.drift import StepDrift

    drift = StepDrift()
    deep = plan_step(CostModel(COSTS, drift=drift), [HIGH] * 8, [None] * 8)
    assert max(deep.ks) > 2
    for _ in range(40):
        drift.observe(0, 1.0, 1.0, batch=8)
        for k in (1, 2):
            drift.observe(k, 1.0, 1.0, batch=8)
        for k in (4, 8):
            drift.observe(k, 1.5, 1.0, batch=8)
    shallow = plan_step(CostModel(COSTS, drift=drift), [HIGH] * 8, [None] * 8)
    assert 0 < max(shallow.ks) <= 2


def test_rows_at_different_widths_pay_the_packed_verifys_surcharge():
    """A verify whose rows differ in width runs packed, at ``ragged_s`` over the uniform verify of its
    tokens: a plan is priced with it, so two rows a little apart in acceptance verify at one width
    where the surcharge outweighs what the shallower row's last positions saved."""
    costs = dataclasses.replace(COSTS, ragged_s=(0.0, 0.002, 0.004))
    assert StepCosts.from_dict(costs.to_dict()) == costs
    model, uniform_priced = CostModel(costs), CostModel(COSTS)
    uneven = [4] * 4 + [0] * 4
    assert model.ragged_step_time(8, uneven) == pytest.approx(uniform_priced.ragged_step_time(8, uneven) + 0.002)
    assert model.ragged_step_time(8, [4] * 8) == pytest.approx(uniform_priced.ragged_step_time(8, [4] * 8))
    rows = [survival([0.95] * 8), survival([0.8] * 8)]
    apart = plan_step(uniform_priced, rows, [None, None])
    assert apart.ks[0] > apart.ks[1] > 0
    even = plan_step(CostModel(dataclasses.replace(COSTS, ragged_s=(0.0, 0.002, 0.002))), rows, [None, None])
    assert even.ks[0] == even.ks[1]
    assert even.step_s == pytest.approx(model.ragged_step_time(2, list(even.ks)))


def test_a_depth_not_yet_measured_runs_inside_the_margin_until_it_is():
    """A plan that beats plain by less than the margin runs while steps of its depth are unmeasured at its
    batch, so that the drift learns their price; once they are (here: as calibrated), the margin decides.
    A plan that loses to plain never runs to be measured."""
    survivals = [survival([0.3] * 4)]
    gain = plan_step(MODEL, survivals, [None], margin=0.0).predicted_speedup
    margin = gain - 1 + 0.01
    assert any(plan_step(MODEL, survivals, [None], margin=margin, unmeasured=lambda k: True).ks)
    assert not any(plan_step(MODEL, survivals, [None], margin=margin, unmeasured=lambda k: False).ks)
    assert not any(plan_step(MODEL, [survival([0.05] * 4)], [None], unmeasured=lambda k: True).ks)

    policy, cls = _policy(prior_mean=0.4)
    for accepted in [1, 1, 0, 0, 0] * 40:
        policy.observe(cls, 1, accepted)
    rows = dict(classes=[cls] * 4, evidence=[([], [], None)] * 4, k_maxes=[4] * 4, fixed=[None] * 4,
                context_len=64, plain_runs=[0] * 4, catch_up=[1] * 4, remaining=[64] * 4)
    explored = policy.plan_budget(**rows)
    assert any(explored.ks) and explored.predicted_speedup < 1.0 + BUDGET_MARGIN
    for _ in range(policy.view.drift.min_steps):
        for ks in ([0] * 4, list(explored.ks)):
            policy.observe_ragged_step([cls] * 4, 64, ks, MODEL.ragged_step_time(4, ks, calibrated=True))
    assert not any(policy.plan_budget(**rows).ks)


def test_a_row_starts_where_its_steps_clear_the_margin_and_its_catch_up_is_paid_back():
    """The margin guards the steps' price; a row's catch-up is a cost of its own, paid once, and need only
    be paid back. Before, the catch-up's share was in the price that had to clear the margin: rows whose
    K=2 steps priced 1.18x plain started at 1.09x with it, stayed plain, and their drafts fell further
    behind every step (new requests of a mixed batch at batch 4 ran plain to their end)."""
    survivals = [survival([0.7] * 4)] * 4
    steady = plan_step(MODEL, survivals, [None] * 4)
    assert steady.predicted_speedup > 1.0 + BUDGET_MARGIN
    for over_plain, starts in ((1.05, True), (0.95, False)):
        start_s = steady.step_s * (steady.predicted_speedup / over_plain - 1.0) / 4
        plan = plan_step(MODEL, survivals, [None] * 4, start_s=[start_s] * 4)
        assert any(plan.ks) == starts, (over_plain, plan)
