"""The scheduler on its own (``specdec_core/scheduler.py``), against a fake executor (``tests/scheduling.py``).
The scheduler is what both topologies share: join and leave at step boundaries, K per row, draft fallback with
a retry time (fake clock), overlapped proposals kept or dropped, errors that fail one row, aborts. What its
steps teach adaptive K, and its budgeted plans: ``test_scheduler_adaptive.py``."""

from __future__ import annotations

import pytest
from scheduling import Clock, FakeExecutor, reference, request, run

from specdec_core import Proposal, SamplingParams
from specdec_core.acceptance import AcceptanceTracker
from specdec_core.adaptive import AdaptiveK
from specdec_core.cost_view import CostView
from specdec_core.scheduler import Scheduler
from specdec_core.stats import StepTiming
from specdec_core.step_costs import StepCosts


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


def _step(sched, ex, timing: StepTiming | None = None):
    plan = sched.schedule(free_slots=8)
    result = ex.execute(plan)
    if timing is not None:
        result.timing = timing
    sched.commit(plan, result)
    return plan


def test_a_prefill_beside_decode_rows_costs_them_only_what_their_forward_did_not_cost_alone():
    """The executor times one forward for a step's prefill and decode rows. The decode rows' share is what
    their verify costs alone (``DecodeClock``: learnt from forwards of decode rows only), the prefill's the
    rest: the running row took part in its decode (``decode_s``) and waited for the prefill
    (``prefill_wait_s``); the new request waited for nothing. What routing learns step costs from leaves
    the waits out (``pools._decode_time_per_token``). Split by tokens, the row would be charged 4/5 of 0.5 s
    of a forward that costs it 0.2 s alone."""
    sched, ex = Scheduler(4, 256, speculative=True), FakeExecutor()
    first, later = request("r0", n=40, k=3), request("r1", n=40, k=3)
    sched.add(first)
    _step(sched, ex)  # its prefill
    _step(sched, ex, StepTiming(propose_s=0.1, verify_s=0.2, total_s=0.3))  # alone: the clock learns 0.2 s
    sched.add(later)
    plan = _step(sched, ex, StepTiming(propose_s=0.1, verify_s=0.5, total_s=0.6))  # 4 decode tokens, 1 prefill
    assert plan.prefill == (later,) and plan.decode == (first,)
    plan = _step(sched, ex, StepTiming(propose_s=0.1, verify_s=0.15, total_s=0.25))
    assert plan.decode == (first, later) and not plan.prefill
    assert (first.stats.decode_s, first.stats.prefill_wait_s) == pytest.approx((0.85, 0.3))
    assert (later.stats.decode_s, later.stats.prefill_wait_s) == pytest.approx((0.25, 0.0))


def test_before_any_decode_forward_alone_the_whole_packed_forward_is_the_decode_rows_and_teaches_no_drift():
    """Before the clock has seen decode rows alone at this batch, the whole forward is theirs (what was
    measured, not a guess); a forward that carried a prefill teaches the drift nothing: its decode share
    was priced, not measured."""
    costs = StepCosts(batches=(1, 2), qs=(1, 4), target_s=((0.1, 0.1), (0.1, 0.1)), draft_s=(0.01, 0.01))
    adaptive = AdaptiveK(CostView(costs), AcceptanceTracker(prior_mean=0.95), "d", "colocated")
    sched, ex = Scheduler(4, 256, speculative=True, adaptive=adaptive), FakeExecutor()
    first, later = request("r0", n=40, k=3, adaptive_k=True), request("r1", n=40, k=3, adaptive_k=True)
    sched.add(first)
    _step(sched, ex)
    sched.add(later)
    _step(sched, ex, StepTiming(propose_s=0.1, verify_s=0.5, total_s=0.6))
    assert (first.stats.decode_s, first.stats.prefill_wait_s) == pytest.approx((0.6, 0.0))
    assert not adaptive.measured.buckets and not adaptive.view.drift.buckets
    _step(sched, ex, StepTiming(propose_s=0.1, verify_s=0.2, total_s=0.3))  # decode rows alone: the drift learns
    assert adaptive.measured.buckets
