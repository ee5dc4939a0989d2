"""The scheduler on its own (``specdec_core/scheduler.py``), against a fake executor: a "target" whose
greedy next token is (last + 1) mod V and a "draft" that proposes it right for ``good`` positions and
wrong after. The scheduler is what both topologies share: join and leave at step boundaries, K per
row, draft fallback with a retry time (fake clock), overlapped proposals kept or dropped, errors
that fail one row, aborts."""

from __future__ import annotations

import itertools
import math

import pytest

from specdec_core import Proposal, SamplingParams
from specdec_core.acceptance import AcceptanceTracker
from specdec_core.adaptive import AdaptiveK, KState, Phase
from specdec_core.cost_view import CostView
from specdec_core.scheduler import NO_PROPOSAL, ScheduledRequest, Scheduler, StepPlan, StepResult
from specdec_core.step_costs import StepCosts
from specdec_core.verifier import VerifyResult

V = 50


class _Tok:
    def decode(self, ids, skip_special_tokens=True):
        return " ".join(map(str, ids))


def nxt(t: int) -> int:
    return (t + 1) % V


class FakeExecutor:
    """Greedy verification against the (last + 1) target; the draft right for ``good`` tokens."""

    def __init__(self, good: int = 99, overlap: bool = False):
        self.good, self.overlap = good, overlap
        self.fail_draft: set[str] = set()  # request ids whose next propose fails
        self.fail_verify: set[str] = set()
        self.plans: list[StepPlan] = []
        self.judged_carried = 0  # rows whose verify judged a proposal made during the previous verify

    def propose(self, history: list[int], k: int) -> Proposal:
        out, t = [], history[-1]
        for i in range(k):
            t = nxt(t) if i < self.good else (t + 7) % V
            out.append(t)
        return Proposal(out, None)

    def execute(self, plan: StepPlan) -> StepResult:
        self.plans.append(plan)
        proposals, failed = [], set()
        for i, (r, k) in enumerate(zip(plan.decode, plan.ks)):
            if r.carried is not None:
                proposals.append(r.carried)
                self.judged_carried += 1
            elif k and r.request_id in self.fail_draft:
                self.fail_draft.discard(r.request_id)
                proposals.append(NO_PROPOSAL)
                failed.add(i)
            else:
                proposals.append(self.propose(r.tokens, k) if k else NO_PROPOSAL)
        verified = []
        for r, p in zip(plan.rows, [NO_PROPOSAL] * len(plan.prefill) + proposals):
            if r.request_id in self.fail_verify:
                verified.append(RuntimeError("verify failed"))
                continue
            t, accepted = r.tokens[-1], []
            for tok in p.token_ids:
                if tok != nxt(t):
                    break
                accepted.append(tok)
                t = tok
            verified.append(VerifyResult(accepted + [nxt(t)], len(p.token_ids), len(accepted)))
        ahead = {}
        if self.overlap:
            for i, (r, p) in enumerate(zip(plan.decode, proposals)):
                if p.token_ids:
                    ahead[i] = self.propose(r.tokens + p.token_ids, len(p.token_ids))
        return StepResult(proposals, verified, failed, ahead)


class Clock:
    def __init__(self):
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def request(rid: str, n: int = 12, k: int = 3, start: int = 1, **kw) -> ScheduledRequest:
    params = SamplingParams(max_new_tokens=n, num_speculative_tokens=k, ignore_eos=True, **kw)
    return ScheduledRequest(rid, [start], params, _Tok(), eos_ids=set())


def run(sched: Scheduler, ex: FakeExecutor, steps: int = 100) -> dict[str, list[int]]:
    done = {}
    for _ in range(steps):
        if not sched.has_work():
            break
        plan = sched.schedule(free_slots=8)
        for out in sched.commit(plan, ex.execute(plan)):
            if out.finished:
                done[out.request_id] = out.token_ids
    return done


def reference(start: int, n: int) -> list[int]:
    out, t = [], start
    for _ in range(n):
        t = nxt(t)
        out.append(t)
    return out


@pytest.mark.parametrize("good, overlap", [(99, False), (1, False), (0, False), (99, True), (2, True)])
def test_output_is_the_targets_greedy_whatever_the_draft(good, overlap):
    sched, ex = Scheduler(4, 256, speculative=True), FakeExecutor(good, overlap)
    for i in range(3):
        sched.add(request(f"r{i}", n=10 + i, start=i))
    assert run(sched, ex) == {f"r{i}": reference(i, 10 + i) for i in range(3)}
    assert (ex.judged_carried > 0) == (overlap and good > 0)  # overlapped rounds kept where all was accepted


def test_requests_join_and_leave_at_step_boundaries():
    sched, ex = Scheduler(2, 256, speculative=True), FakeExecutor()
    for i in range(3):
        sched.add(request(f"r{i}", n=4 * (i + 1)))
    plan = sched.schedule(free_slots=8)
    assert [r.request_id for r in plan.prefill] == ["r0", "r1"] and not plan.decode  # the batch bound: 2
    sched.commit(plan, ex.execute(plan))
    plan = sched.schedule(free_slots=8)
    assert [r.request_id for r in plan.decode] == ["r0", "r1"] and plan.ks == (2, 3) and not plan.prefill
    sched.commit(plan, ex.execute(plan))  # r0 (3 tokens left: K=2): 1 + 3 = its 4 tokens, it leaves
    plan = sched.schedule(free_slots=8)
    assert [r.request_id for r in plan.prefill] == ["r2"] and [r.request_id for r in plan.decode] == ["r1"]
    assert sched.schedule(free_slots=0).prefill == ()  # no free slot: nothing admitted


def test_k_is_cut_at_the_token_budget_and_the_context():
    sched = Scheduler(4, 8, speculative=True)
    sched.add(request("a", n=3, k=5))
    sched.add(request("b", n=6, k=5))
    sched.commit(plan := sched.schedule(8), FakeExecutor().execute(plan))
    plan = sched.schedule(8)
    assert plan.ks == (1, 4)  # a: 2 tokens left, room for 1 draft token; b: 5 left, 4


def test_a_failed_draft_decodes_plain_until_its_retry_time():
    clock = Clock()
    sched, ex = Scheduler(4, 256, speculative=True, draft_retry_s=5.0, clock=clock), FakeExecutor()
    sched.add(request("a", n=40))
    sched.add(request("b", n=40))
    sched.commit(plan := sched.schedule(8), ex.execute(plan))
    ex.fail_draft.add("a")
    sched.commit(plan := sched.schedule(8), ex.execute(plan))
    a, b = plan.decode
    assert a.draft_failed and not b.draft_failed
    assert sched.schedule(8).ks == (0, 3)  # a plain, b speculates
    clock.t = 5.0
    plan = sched.schedule(8)
    assert plan.ks == (3, 3)
    assert run(sched, ex)  # and a finishes right
    assert a.output_ids == reference(1, 40)


class LookupExecutor(FakeExecutor):
    """A lookup-like proposer: at most ``longest`` tokens, however many were asked."""

    def __init__(self, longest: int):
        super().__init__()
        self.longest = longest

    def propose(self, history: list[int], k: int) -> Proposal:
        return super().propose(history, min(k, self.longest))


def test_what_a_proposer_delivers_of_what_was_asked_is_counted_per_row():
    """The budget's planner discounts positions a row's proposer does not deliver (``ProposalCoverage``):
    under a budgeted plan each row counts the K it was asked for and the tokens that came back; a failed
    draft is no answer. Without a budget nothing reads it, and nothing is counted."""
    cheap = StepCosts((1, 8), (1, 5), ((1.0, 1.01), (1.0, 1.01)), (0.001, 0.001), source="test")
    adaptive = AdaptiveK(CostView(cheap), AcceptanceTracker(prior_mean=0.95), "d", "colocated", budgeted=True)
    for _ in range(50):  # the class accepts everything: the plan asks deep
        adaptive.observe(adaptive.traffic_class(0.0, SamplingParams().domain), 4, 4)
    sched, ex = Scheduler(4, 256, speculative=True, adaptive=adaptive), LookupExecutor(longest=2)
    sched.add(request("a", n=40, k=4, adaptive_k=True))
    sched.commit(plan := sched.schedule(8), ex.execute(plan))
    a = plan.prefill[0]
    sched.commit(plan := sched.schedule(8), ex.execute(plan))  # the drift's reference: a plain step
    assert plan.ks == (0,) and a.coverage.asked == []
    sched.commit(plan := sched.schedule(8), ex.execute(plan))
    asked = plan.ks[0]
    assert asked > 2 and a.coverage.asked == [1] * asked and a.coverage.offered == [1, 1] + [0] * (asked - 2)
    ex.fail_draft.add("a")
    sched.commit(plan := sched.schedule(8), ex.execute(plan))
    assert a.draft_failed and a.coverage.asked == [1] * asked
    assert run(sched, FakeExecutor()) and a.output_ids == reference(1, 40)
    sched_b = Scheduler(4, 256, speculative=True)
    sched_b.add(request("b", n=8, k=4))
    sched_b.commit(plan := sched_b.schedule(8), LookupExecutor(longest=2).execute(plan))
    b = plan.prefill[0]
    sched_b.commit(plan := sched_b.schedule(8), LookupExecutor(longest=2).execute(plan))
    assert plan.ks == (4,) and b.coverage.asked == []


def test_a_row_that_fails_fails_alone():
    sched, ex = Scheduler(4, 256, speculative=True), FakeExecutor()
    sched.add(request("a"))
    sched.add(request("b"))
    sched.commit(plan := sched.schedule(8), ex.execute(plan))
    ex.fail_verify.add("a")
    plan = sched.schedule(8)
    outs = {o.request_id: o for o in sched.commit(plan, ex.execute(plan))}
    a = plan.decode[0]
    assert outs["a"].finish_reason == "error" and isinstance(a.error, RuntimeError)
    assert not outs["b"].finished and [r.request_id for r in sched.running] == ["b"]


def test_aborts_leave_at_the_next_boundary_waiting_or_running():
    sched, ex = Scheduler(1, 256, speculative=True), FakeExecutor()
    sched.add(request("run"))
    sched.add(request("wait"))
    sched.commit(plan := sched.schedule(8), ex.execute(plan))
    sched.abort("run")
    sched.abort("wait")
    plan = sched.schedule(8)
    outs = sched.commit(plan, ex.execute(plan))
    assert {r.request_id for r in plan.aborted} == {"run", "wait"} and not plan.rows
    assert sorted((o.request_id, o.finish_reason) for o in outs) == [("run", "abort"), ("wait", "abort")]
    assert not sched.has_work()


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
            max_new_tokens=64, num_speculative_tokens=4, adaptive_k=True, ignore_eos=True), _Tok(), set())
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
    import dataclasses

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
    rows = [ScheduledRequest("short", [1] * 2, params, _Tok(), eos_ids=set()),
            ScheduledRequest("long", [1] * 190, params, _Tok(), eos_ids=set())]
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
