"""A fake executor for the scheduler's tests (``specdec_core/scheduler.py`` on its own): a "target" whose greedy
next token is (last + 1) mod V and a "draft" that proposes it right for ``good`` positions and wrong after."""

from __future__ import annotations

from specdec_core import Proposal, SamplingParams
from specdec_core.scheduler import NO_PROPOSAL, ScheduledRequest, Scheduler, StepPlan, StepResult
from specdec_core.verifier import VerifyResult

V = 50


class Tok:
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
    return ScheduledRequest(rid, [start], params, Tok(), eos_ids=set())


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
