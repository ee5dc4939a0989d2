"""The scheduler with adaptive K (``specdec_core/scheduler.py``, ``specdec_core/adaptive.py``), against a fake
executor (``tests/scheduling.py``): rows taking AdaptiveK's K, what its steps teach (the drift, the regret
guard's plain step, the context a step is priced at) and the budgeted plans that stand or re-plan."""

from __future__ import annotations

import dataclasses
import itertools
import math

import pytest
from scheduling import FakeExecutor, Tok, request, run

from specdec_core import SamplingParams
from specdec_core.acceptance import AcceptanceTracker
from specdec_core.adaptive import AdaptiveK, KState, Phase
from specdec_core.cost_view import CostView
from specdec_core.scheduler import ScheduledRequest, Scheduler
from specdec_core.step_costs import StepCosts


def test_adaptive_k_is_the_seam_a_draft_that_costs_a_verify_goes_plain():
    """mode=auto rows take AdaptiveK's K (the same policy in either topology): with a draft step as
    expensive as a target step nothing pays and they decode plain; a fixed-K row keeps its K."""
    costly = StepCosts((1, 8), (1, 5), ((1.0, 1.2), (1.0, 1.2)), (1.0, 1.0), source="test")
    adaptive = AdaptiveK(CostView(costly), AcceptanceTracker(prior_mean=0.5), "d", "separate")
    sched, ex = Scheduler(4, 256, speculative=True, adaptive=adaptive), FakeExecutor()
    sched.add(request("auto", n=30, k=4, adaptive_k=True))
    sched.add(request("fixed", n=30, k=4))
    sched.commit(plan := sched.schedule(8), ex.execute(plan))
    plan = sched.schedule(8)
    assert plan.ks == (0, 4)
    assert plan.decode[0].k_state is not None


def test_a_drafts_catch_up_prefill_is_no_regret():
    """A long prompt's first speculative step also prefills the draft on the whole prompt: slow, and
    priced when the row chose to speculate. It must not count against speculation (the regret guard
    would stop the request there: seen as auto at 0.84x of the best mode on long prompts); a slow
    steady step does."""
    from specdec_core.adaptive import Phase

    cheap = StepCosts((1, 8), (1, 5), ((1.0, 1.0), (1.0, 1.0)), (0.05, 0.05), source="test")

    def slow_spec_steps(prompt_len: int, steps: int) -> ScheduledRequest:
        """The prefill, the regret guard's reference (a plain step, as calibrated), then ``steps``
        speculative steps of 30 plain steps' worth each; the first of them catches the draft up."""
        adaptive = AdaptiveK(CostView(cheap), AcceptanceTracker(prior_mean=0.8), "d", "colocated")
        sched, ex = Scheduler(4, 1024, speculative=True, adaptive=adaptive), FakeExecutor(good=0)
        req = ScheduledRequest("r", list(range(1, prompt_len + 1)), SamplingParams(
            max_new_tokens=64, num_speculative_tokens=4, adaptive_k=True, ignore_eos=True), Tok(), set())
        sched.add(req)
        for _ in range(2 + steps):
            plan = sched.schedule(8)
            result = ex.execute(plan)
            result.timing.propose_s = 30.0 if any(plan.ks) else 0.0
            result.timing.verify_s = 1.0 if plan.decode else 0.0
            sched.commit(plan, result)
        return req

    for prompt_len in (500, 1):
        req = slow_spec_steps(prompt_len, steps=1)  # the catch-up step, however long the prompt
        assert req.stats.proposed > 0 and req.k_state.phase is not Phase.STOPPED
    req = slow_spec_steps(prompt_len=500, steps=2)  # nothing to catch up on: the slow step is a real loss
    assert req.stats.verify_steps == 2 and req.k_state.phase is Phase.SPECULATING and req.regret.k_cap == 2


def test_plain_steps_after_plain_steps_still_teach_the_measured_plain_step():
    """A row that decodes plain leaves its draft further behind every step (its catch-up grows), but
    a plain step feeds no draft: its time is a plain step's, which the regret guard measures against."""
    adaptive = AdaptiveK(CostView(StepCosts((1, 8), (1, 5), ((1.0, 1.2), (1.0, 1.2)), (1.0, 1.0), source="t")),
                         AcceptanceTracker(prior_mean=0.5), "d", "colocated")
    sched, ex = Scheduler(4, 256, speculative=True, adaptive=adaptive), FakeExecutor()
    sched.add(request("auto", n=60, k=4, adaptive_k=True))
    for step in range(50):
        plan = sched.schedule(8)
        result = ex.execute(plan)
        # plain steps as calibrated at first, then twice as slow (another tenant, a served replica's loop)
        result.timing.verify_s = (1.0 if step < 3 else 2.0) if plan.decode else 0.0
        sched.commit(plan, result)
    assert plan.ks == (0,) and plan.decode[0].draft_catch_up > 2
    assert adaptive.plain_step_time([adaptive.traffic_class(0.0, "default")], 8) > 1.8


def test_a_machine_slower_than_its_calibration_stops_no_paying_request():
    """Served, a replica shares its cores: every step ran ~1.6x its idle calibration. Judged against
    the calibrated plain step, each speculative step looked like a loss and auto requests stopped
    after a few steps; judged against this engine's own measured plain step (the reference step, the
    first decode step here) speculation that pays keeps paying."""
    from specdec_core.adaptive import REFERENCE_EVERY, Phase

    # K=2 pays 1.5x as calibrated (a 2.0 step for 3 tokens: the draft is right twice, then the bonus);
    # at 1.6x that step is 3.2, over 3 calibrated plain steps but under 3 measured ones (4.8)
    costs = StepCosts((1, 8), (1, 5), ((1.0, 1.8), (1.0, 1.8)), (0.3, 0.3), source="test")
    adaptive = AdaptiveK(CostView(costs), AcceptanceTracker(prior_mean=0.8), "d", "colocated")
    sched, ex = Scheduler(4, 4096, speculative=True, adaptive=adaptive), FakeExecutor(good=2)
    req = request("auto", n=400, k=4, adaptive_k=True)
    sched.add(req)
    ks = []
    while sched.has_work():
        plan = sched.schedule(8)
        result = ex.execute(plan)
        k = max(plan.ks, default=0)
        result.timing.propose_s = 1.6 * 0.3 * k if plan.decode else 0.0
        result.timing.verify_s = 1.6 * costs.target_time(1, k + 1) if plan.decode else 0.0
        sched.commit(plan, result)
        ks += list(plan.ks)
    assert req.k_state.phase is not Phase.STOPPED and req.stats.verify_steps > 100
    plain_at = [i for i, k in enumerate(ks[:-1]) if k == 0]  # (the last step may be K=0: the token budget)
    assert plain_at[0] == 0 and len(plain_at) >= 2  # the first decode step is the reference, then one per period
    assert all(REFERENCE_EVERY <= b - a <= REFERENCE_EVERY + 2 for a, b in itertools.pairwise(plain_at)), plain_at


def test_a_speculating_batch_lifts_a_stopped_row_to_k1_but_not_a_failed_draft():
    """Left plain in a batch whose other rows speculate, a row takes a whole speculative step per token
    (the p99 of a served load). Where the batch gains, a row its regret guard stopped rides along at
    K=1, the K it lost last; a row whose draft failed stays plain until its retry time."""
    memory_bound = StepCosts((1, 16), (1, 9), ((0.010, 0.011), (0.012, 0.016)), (0.0005, 0.001), source="test")
    adaptive = AdaptiveK(CostView(memory_bound), AcceptanceTracker(prior_mean=0.9), "d")
    sched, ex = Scheduler(4, 256, speculative=True, adaptive=adaptive), FakeExecutor()
    rows = [request(f"r{i}", n=30, k=4, adaptive_k=True) for i in range(3)]
    for r in rows:
        sched.add(r)
    for _ in range(2):  # the prefill, then the regret guard's plain reference step
        sched.commit(plan := sched.schedule(8), ex.execute(plan))
    stopped, failed = rows[1], rows[2]
    stopped.k_state = stopped.regret.trip(KState(Phase.SPECULATING, 1))
    failed.draft_retry_at = math.inf
    plan = sched.schedule(8)
    assert stopped.k_state.phase is Phase.STOPPED and plan.ks[0] > 1
    assert plan.ks[1:] == (1, 0)


class CountingPlans(AdaptiveK):
    """The real policy, counting the budgeted plans it makes."""

    plans = 0

    def plan_budget(self, *args, **kwargs):
        self.plans += 1
        return super().plan_budget(*args, **kwargs)


def test_a_plain_plan_stands_until_its_rows_or_a_due_probe_change_it():
    """A batch planned plain judges nothing, so its plan stands (re-made every ``REPRICE_EVERY`` steps, as
    a plain request is re-priced), but not past what can change it: a row that joins is planned the step it
    joins (its class accepts everything: it speculates at once), and a row whose probe comes due probes
    that step."""
    from specdec_core.adaptive import REPRICE_EVERY

    memory_bound = StepCosts((1, 16), (1, 9), ((0.010, 0.011), (0.012, 0.016)), (0.0005, 0.001), source="test")
    adaptive = CountingPlans(CostView(memory_bound), AcceptanceTracker(prior_mean=0.5), "d", budgeted=True)
    for _ in range(200):
        adaptive.observe(adaptive.traffic_class(0.0, "bad"), 1, 0)  # the batch's class: nothing accepted
        adaptive.observe(adaptive.traffic_class(0.0, "good"), 4, 4)
    sched, ex = Scheduler(4, 256, speculative=True, adaptive=adaptive), FakeExecutor()
    bad = [request(f"b{i}", n=60, k=4, adaptive_k=True, domain="bad") for i in range(2)]
    for r in bad:
        sched.add(r)
    plain_steps = plans_on_plain = probes = 0
    for step in range(40):
        if step == 30:
            sched.add(request("g", n=20, k=4, adaptive_k=True, domain="good"))
        due = any(r.plain_run == adaptive.probe_every for r in bad)
        plans = adaptive.plans
        sched.commit(plan := sched.schedule(8), ex.execute(plan))
        planned = adaptive.plans > plans
        ks = dict(zip((r.request_id for r in plan.decode), plan.ks))
        if due:  # a due probe runs the step it comes due
            assert planned and 1 in (ks["b0"], ks["b1"]), (step, ks)
            probes += 1
        elif step == 32:  # "g" decodes for the first time: planned, and speculating
            assert planned and ks["g"] >= 1, ks
        elif ks and not any(ks.values()):
            plain_steps += 1
            plans_on_plain += planned
    assert probes >= 1 and plain_steps > 20
    assert plans_on_plain <= plain_steps / REPRICE_EVERY + 2  # not once a step


def test_a_plain_rows_lag_keeps_no_speculative_step_from_the_drift():
    """A step's draft feeds only the rows that propose: beside a plain row (its draft falls further behind
    every step) the speculating row's steps are what they are priced as, and teach the drift how such steps
    run. Counted with the plain row's lag, no step of the batch did, and a depth never measured is planned
    past the margin for good (``StepDrift.explored``)."""
    memory_bound = StepCosts((1, 16), (1, 9), ((0.010, 0.011), (0.012, 0.016)), (0.0005, 0.001), source="test")
    adaptive = AdaptiveK(CostView(memory_bound), AcceptanceTracker(prior_mean=0.5), "d", budgeted=True)
    for _ in range(200):
        adaptive.observe(adaptive.traffic_class(0.0, "good"), 4, 4)
    sched, ex = Scheduler(4, 512, speculative=True, adaptive=adaptive), FakeExecutor()
    sched.add(plain_row := request("plain", n=200, k=0))
    sched.add(request("good", n=400, k=4, adaptive_k=True, domain="good"))
    for _ in range(60):
        plan = sched.schedule(8)
        result = ex.execute(plan)
        result.timing.verify_s = 0.012 if plan.decode else 0.0
        sched.commit(plan, result)
    assert plain_row.draft_catch_up > 2 and any(plan.ks)  # the plain row lags; the other speculates
    bucket = adaptive.view.drift.buckets[adaptive.view.drift.bucket(2)]
    assert sum(bucket.depth_steps.values()) > 20


def test_each_row_counts_the_sampled_rows_it_decoded_beside():
    """What the router prices a finished request's steps at (``RequestStats.sampled_share``): a greedy row
    that decoded beside a T=1 row for its whole life ran every step half sampled."""
    sched, ex = Scheduler(4, 256, speculative=True), FakeExecutor()
    sched.add(greedy := request("g", n=10, k=0))
    sched.add(request("s", n=10, k=0, temperature=1.0))
    run(sched, ex)
    assert greedy.stats.decode_steps == 9 and greedy.stats.sampled_share == 0.5


def test_the_regret_guards_plain_step_is_the_batchs_as_measured():
    """A batch of a greedy and a T=1 row ran its plain steps at the blend of the two paths' calibrations; the
    regret guard weighs each speculating row against that step, not against its own path's (the greedy
    path's, 20% cheaper here, would charge a greedy row's speculation with a loss the batch never had)."""
    greedy = StepCosts((1, 8), (1, 5), ((0.010, 0.011), (0.012, 0.016)), (0.0005, 0.001), source="test")
    sampled = dataclasses.replace(greedy, target_s=tuple(tuple(1.5 * t for t in row) for row in greedy.target_s))
    adaptive = AdaptiveK(CostView(greedy, sampled), AcceptanceTracker(), "d")
    classes = [adaptive.traffic_class(0.0, "default"), adaptive.traffic_class(1.0, "default")]
    blend_step = adaptive.step_model(classes, 8).calibrated_step_time(2, 0)
    for _ in range(5):
        adaptive.observe_step(classes, 8, 0, blend_step)
    assert adaptive.plain_step_time(classes, 8) == pytest.approx(blend_step)
    assert blend_step == pytest.approx(1.25 * adaptive.step_model(classes[:1], 8).calibrated_step_time(2, 0))


def test_a_step_is_priced_and_learnt_at_its_rows_mean_context():
    """Attention reads each row's own cache: a step of a short and a long row costs the calibration's slope
    times the sum of their contexts, which their mean prices. Its plain steps, taking exactly that, teach a
    drift of ~1; priced at the longest row they taught 0.87 at a steady batch 8 (rows from just admitted to
    nearly done) while the same bucket's drain (its last, long rows) taught 1.1-1.25."""
    base, slope = 0.010, 2e-5  # seconds; seconds per context token and row
    costs = StepCosts((1, 2), (1, 5), ((base, 0.012), (base, 0.012)), (0.0005, 0.001), source="test",
                      context_len=0, context_slope_s=(slope, slope))
    adaptive = AdaptiveK(CostView(costs), AcceptanceTracker(), "d")
    sched, ex = Scheduler(2, 512, speculative=True, adaptive=adaptive), FakeExecutor()
    params = SamplingParams(max_new_tokens=30, num_speculative_tokens=0, ignore_eos=True)
    rows = [ScheduledRequest("short", [1] * 2, params, Tok(), eos_ids=set()),
            ScheduledRequest("long", [1] * 190, params, Tok(), eos_ids=set())]
    for row in rows:
        sched.add(row)
    for _ in range(28):
        plan = sched.schedule(free_slots=8)
        result = ex.execute(plan)
        if plan.decode:  # what the rows' reads take
            result.timing.verify_s = base + slope * sum(len(r.tokens) for r in plan.decode)
        sched.commit(plan, result)
    assert result.timing.context_len == -(-sum(len(r.tokens) - 1 for r in rows) // 2)
    drift = adaptive.view.drift.buckets[adaptive.view.drift.bucket(2)]
    assert drift.plain_steps >= 20 and drift.plain == pytest.approx(1.0, abs=0.06)
