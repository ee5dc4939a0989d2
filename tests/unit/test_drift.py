"""StepDrift (specdec_core/drift.py): served or real steps against the calibration, learnt per batch bucket,
kind of step and draft depth, and how CostModel prices with it."""

import pytest
from test_costmodel import leviathan_costs

from specdec_core.costmodel import CostModel
from specdec_core.drift import StepDrift


def test_step_drift_moves_a_near_break_even_decision():
    """Calibrated: K=1 edges out plain (8%). Real plain steps then run 20% cheaper than calibrated
    while speculative steps match: the learnt drift makes plain the better choice at that batch,
    and only there; a uniform slowdown of both changes nothing, nor does one side alone."""
    drift = StepDrift()
    cm = CostModel(leviathan_costs(0.2), drift=drift)
    assert cm.best_k(1, 0.3, 4).k > 0
    for _ in range(200):
        drift.observe(0, 0.8, cm.calibrated_step_time(1, 0), batch=1)
        drift.observe(1, cm.calibrated_step_time(1, 1), cm.calibrated_step_time(1, 1), batch=1)
    assert drift.factor(0, 1) == pytest.approx(0.8, abs=0.01) and drift.factor(1, 1) == pytest.approx(1.0)
    assert cm.best_k(1, 0.3, 4).k == 0
    assert cm.best_k(16, 0.3, 4).k > 0  # another batch bucket: nothing learnt there
    uniform = StepDrift()
    one_sided = StepDrift()
    for _ in range(200):
        uniform.observe(0, 1.5, 1.0)
        uniform.observe(2, 1.5, 1.0)
        one_sided.observe(0, 0.8, 1.0)  # only plain steps seen: no evidence about speculation
    assert CostModel(leviathan_costs(0.2), drift=uniform).best_k(1, 0.3, 4).k == cm.best_k(16, 0.3, 4).k
    assert one_sided.factor(0) == one_sided.factor(3) == 1.0
    foreign = StepDrift()
    for _ in range(200):  # a calibration 10x off: another machine's, not drift
        foreign.observe(0, 0.1, 1.0)
        foreign.observe(2, 0.12, 1.0)
    assert foreign.factor(0) == foreign.factor(2) == 1.0
    warm_up = StepDrift()
    for _ in range(30):  # a replica's cold start: stalls far off the calibration
        warm_up.observe(0, 10.0, 1.0)
        warm_up.observe(2, 10.0, 1.0)
    for _ in range(200):  # then steady steps with a real drift
        warm_up.observe(0, 0.8, 1.0)
        warm_up.observe(2, 1.0, 1.0)
    assert warm_up.factor(0) == pytest.approx(0.8, abs=0.01) and warm_up.factor(2) == pytest.approx(1.0, abs=0.01)



def test_drift_prices_each_draft_depth_by_its_own_steps():
    """K=1 steps ran as calibrated, K=4 steps 1.4x their price: each depth prices with its own factor
    (K=3 with K=4's: one bucket), a depth not yet measured (K=2) with all co-located steps' factor, and a
    depth seen fewer than ``min_steps`` times too."""
    drift = StepDrift()
    for _ in range(30):
        drift.observe(0, 1.0, 1.0)
        drift.observe(1, 1.0, 1.0)
        drift.observe(4, 1.4, 1.0)
    for _ in range(5):
        drift.observe(8, 1.9, 1.0)
    assert drift.factor(1) == pytest.approx(1.0) and drift.factor(0) == pytest.approx(1.0)
    assert drift.factor(4) == pytest.approx(1.4) and drift.factor(3) == pytest.approx(1.4)
    mixed = drift.buckets[0].spec
    assert 1.0 < mixed < 1.4
    assert drift.factor(2) == drift.factor(8) == mixed
    # the separate rounds, not measured: the co-located steps of their depth
    assert drift.factor(4, topology="separate") == drift.factor(4) and drift.factor(1, topology="separate") == 1.0
    costs = leviathan_costs(0.1)
    cm = CostModel(costs, drift=drift)
    assert cm.ragged_step_time(1, [3]) == pytest.approx(1.4 * cm.ragged_step_time(1, [3], calibrated=True))
    assert cm.spec_step_time(1, 1) == pytest.approx(cm.calibrated_step_time(1, 1))


def test_a_request_of_several_k_teaches_what_its_speculative_steps_took():
    """Plain steps run 1.2x their price. A request ran 10 plain steps (price 1.0 each) and 5 K=4 and 1
    K=2 steps (2.0 and 1.5): of its 34.8 s, 12 were its plain steps at plain's factor, so its speculative
    ones ran 1.2 * 1.5x theirs, learnt at K=4's depth. One whose speculative steps are under a fifth of
    its priced time teaches its plain steps, its speculative ones priced as learnt."""
    drift = StepDrift()
    for _ in range(30):
        drift.observe(0, 1.2, 1.0)
    price = {0: 1.0, 2: 1.5, 4: 2.0}.__getitem__
    for _ in range(30):
        drift.observe_mixed([10, 0, 1, 0, 5], 12.0 + 1.2 * 1.5 * 11.5, price)
    assert drift.factor(4) == pytest.approx(1.8) and drift.buckets[0].depth_steps == {4: 30}
    plain_steps = drift.buckets[0].plain_steps
    drift.observe_mixed([40, 0, 0, 0, 1], 1.5 * 40 + 1.8 * 2.0, price)  # plain steps at 1.5x their price
    assert drift.buckets[0].spec_steps == 30 and drift.buckets[0].plain_steps == plain_steps + 1
    assert drift.factor(0) == pytest.approx(1.2 + 0.05 * (1.5 - 1.2))


def test_a_phase_of_the_host_moves_every_kind_of_step_with_plain():
    """Plain and K=2 steps both ran 1.2x their price (a slow phase), then a fast phase ran only plain
    steps, at 0.9x: speculation is priced 0.9x too, as it would have run, not 1.2x from minutes before."""
    drift = StepDrift()
    cm = CostModel(leviathan_costs(0.2), drift=drift)
    for _ in range(40):
        drift.observe(0, 1.2, 1.0)
        drift.observe(2, 1.2, 1.0)
    assert drift.factor(0) == pytest.approx(1.2) and drift.factor(2) == pytest.approx(1.2)
    for _ in range(200):
        drift.observe(0, 0.9, 1.0)
    assert drift.factor(0) == pytest.approx(0.9, abs=0.01) and drift.factor(2) == pytest.approx(0.9, abs=0.01)
    assert cm.spec_step_time(1, 2) / cm.plain_time_per_token(1) == pytest.approx(
        cm.calibrated_step_time(1, 2) / cm.calibrated_step_time(1, 0), rel=0.01)


def test_drift_is_learnt_per_topology():
    """Separate rounds measured 0.7x their calibrated price, co-located steps as calibrated: the
    separate topology's price drops and only its; before co-located steps are measured, they keep
    their calibrated price (a borrowed factor only makes steps dearer); plain steps alone change nothing."""
    drift = StepDrift()
    cm = CostModel(leviathan_costs(0.2), drift=drift)
    for _ in range(30):
        drift.observe(0, 1.0, 1.0, batch=1)
    assert drift.factor(2, 1, "separate") == drift.factor(2, 1) == 1.0  # one side alone: no evidence
    for _ in range(30):
        drift.observe(2, 0.7, 1.0, batch=1, topology="separate")
    assert drift.measured(1, "separate") and not drift.measured(1, "colocated")
    assert drift.factor(2, 1, "separate") == pytest.approx(0.7) and drift.factor(2, 1) == 1.0
    for _ in range(30):
        drift.observe(2, 1.0, 1.0, batch=1)
    assert drift.factor(2, 1, "separate") == pytest.approx(0.7) and drift.factor(2, 1) == pytest.approx(1.0)
    assert drift.factor(0, 1) == pytest.approx(1.0)
    assert cm.spec_step_time(1, 2, "separate") == pytest.approx(0.7 * cm.calibrated_step_time(1, 2, "separate"))
    assert cm.spec_step_time(1, 2) == pytest.approx(cm.calibrated_step_time(1, 2))


def test_speculative_steps_seen_before_plain_ones_are_priced_as_they_ran():
    """A budgeted engine speculates from its first steps; its plain steps come later (a plain load, the
    regret guard's reference steps). K=4 steps ran 1.2x their calibration, plain steps 0.8x: once plain is
    established the K=4 steps are priced at 1.2x still, not at 1.2x relative to a plain factor nobody had
    measured when they ran (0.96x); steps after that are learnt relative to plain, as before."""
    drift = StepDrift()
    for _ in range(30):
        drift.observe(4, 1.2, 1.0)
    assert drift.factor(4) == 1.0  # no plain step yet: the calibration as it is
    for _ in range(20):
        drift.observe(0, 0.8, 1.0)
    assert drift.factor(0) == pytest.approx(0.8) and drift.factor(4) == pytest.approx(1.2)
    assert drift.factor(2) == pytest.approx(1.2)  # all co-located steps' factor
    for _ in range(200):  # the host slows down: both kinds alike, their ratio kept
        drift.observe(0, 1.0, 1.0)
        drift.observe(4, 1.5, 1.0)
    assert drift.factor(0) == pytest.approx(1.0, abs=0.01) and drift.factor(4) == pytest.approx(1.5, abs=0.02)


def test_a_calibration_twice_too_dear_is_still_learnt():
    """On an Intel Xeon host the calibration priced batch-8 plain steps at 2.1-2.3x what they took. That is
    this machine's error, not another machine's costs: the steps are learnt (plain at 0.45, speculative
    steps at 0.8), not left out with the calibration kept as it is. A calibration 10x off still is."""
    drift = StepDrift()
    for _ in range(40):
        drift.observe(0, 0.45, 1.0)
        drift.observe(2, 0.8, 1.0)
    assert drift.factor(0) == pytest.approx(0.45) and drift.factor(2) == pytest.approx(0.8)


def test_a_batch_no_step_has_run_at_is_priced_with_the_adjacent_buckets_factors():
    """Batch 9-16 learnt plain steps at 1.5x the calibration and K=2 steps at 1.2x plain: a request priced at
    batch 20 (17-32, where no step ran) takes those factors, not the calibration; batch 64 (two powers of two
    off) and a bucket off the calibration keep the calibration."""
    drift = StepDrift()
    for _ in range(30):
        drift.observe(0, 1.5, 1.0, batch=16)
        drift.observe(2, 1.8, 1.0, batch=16)
    assert drift.factor(0, 20) == drift.factor(0, 16) == pytest.approx(1.5)
    assert drift.factor(2, 20) == drift.factor(2, 16) == pytest.approx(1.8, rel=0.05)
    assert drift.factor(2, 64) == drift.factor(0, 64) == 1.0
    assert drift.factor(2, 5) == drift.factor(2, 16)
    for _ in range(30):
        drift.observe(0, 10.0, 1.0, batch=32)  # batch 17-32 ran on other hardware: its own steps say so
    assert drift.factor(2, 20) == drift.factor(0, 20) == 1.0


def test_a_factor_learnt_on_other_steps_prices_unmeasured_steps_only_where_it_makes_them_dearer():
    """K=4 co-located steps at batch 16 ran 0.8x their price relative to plain: K=1 and K=2 steps there, and the
    separate topology's unmeasured rounds, keep their calibrated price (served, K=1-2 priced with K=4's factor
    looked 1.2-1.5x plain where co-located ran 0.79x). Where K=4 ran 1.3x, every unmeasured depth and the
    separate rounds are priced 1.3x too."""
    for ratio, unmeasured in ((0.8, 1.0), (1.3, 1.3)):
        drift = StepDrift()
        for _ in range(30):
            drift.observe(0, 1.0, 1.0, batch=16)
            drift.observe(4, ratio, 1.0, batch=16)
        assert drift.factor(4, 16) == pytest.approx(ratio)
        assert drift.factor(1, 16) == drift.factor(2, 16) == pytest.approx(unmeasured)
        assert drift.factor(4, 16, "separate") == drift.factor(1, 16, "separate") == pytest.approx(unmeasured)
