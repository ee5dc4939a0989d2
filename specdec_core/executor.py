"""The in-process executor: runs a ``StepPlan``'s forwards (``scheduler.py``) on this process's models.

One execute = the proposer's K draft tokens for the speculative rows, batched, then one batched target
pass that verifies them (``Verifier``, Leviathan et al. 2023, Algorithm 1: q the draft's distribution,
p the target's; accepted tokens plus one recovered or bonus token), plain rows included, and runs the
admitted requests' prefill beside them (a verify with nothing proposed: it emits their first token). The
separate topology's executor (``deployments/channel_executor.py``) runs the same plan over channels.

A proposer that fails degrades its rows to plain steps (``StepResult.draft_failed``); it never loses them.
"""

from __future__ import annotations

import logging
import time

from specdec_core.proposers import Proposal, ProposalRequest, Proposer
from specdec_core.scheduler import NO_PROPOSAL, ScheduledRequest, StepPlan, StepResult
from specdec_core.stats import StepTiming
from specdec_core.verifier import Verifier, VerifyItem, VerifyResult

logger = logging.getLogger(__name__)


class LocalExecutor:
    def __init__(self, verifier: Verifier, proposer: Proposer | None = None):
        self.verifier = verifier
        self.proposer = proposer

    @property
    def free_slots(self) -> int:
        return self.verifier.runner.num_free_slots

    def slot_of(self, request_id: str) -> int:
        return self.verifier.slots.slot(request_id)

    def execute(self, plan: StepPlan) -> StepResult:
        """Run the plan; raises if a forward fails (the caller isolates the failure). The prefill rows
        verify in the decode rows' forward (one stream of the target's weights for both); ``verify_s``
        times that forward, prefills included (``Scheduler.commit`` splits it)."""
        timing = StepTiming()
        proposals, failed = [], set()
        if plan.decode:
            t = time.perf_counter()
            proposals, failed = self._propose(plan.decode, plan.ks)
            timing.propose_s = time.perf_counter() - t
        verified: list[VerifyResult] = []
        if plan.rows:
            t = time.perf_counter()
            verified = self._verify(plan.rows, [NO_PROPOSAL] * len(plan.prefill) + proposals)
            timing.verify_s = time.perf_counter() - t
        timing.total_s = timing.propose_s + timing.verify_s
        return StepResult(proposals, verified, failed, timing=timing)

    def release(self, request_id: str) -> None:
        self.verifier.release(request_id)
        if self.proposer is not None:
            self.proposer.release(request_id)

    def _propose(self, rows: tuple[ScheduledRequest, ...], ks: tuple[int, ...]) -> tuple[list[Proposal], set[int]]:
        proposals = [NO_PROPOSAL] * len(rows)
        spec = [i for i, k in enumerate(ks) if k > 0]
        if not spec:
            return proposals, set()
        requests = [
            ProposalRequest(rows[i].request_id, rows[i].tokens, ks[i], rows[i].params.temperature,
                            rows[i].params.top_p, rows[i].params.top_k, rows[i].generator)
            for i in spec
        ]
        try:
            for i, prop in zip(spec, self.proposer.propose(requests)):
                proposals[i] = prop
        except Exception:
            logger.exception("proposer failed; %d request(s) fall back to plain decoding", len(spec))
            for i in spec:
                self.proposer.release(rows[i].request_id)
            return [NO_PROPOSAL] * len(rows), set(spec)
        return proposals, set()

    def _verify(self, rows: tuple[ScheduledRequest, ...], proposals: list[Proposal]) -> list[VerifyResult]:
        items = [VerifyItem(r.request_id, r.tokens, p, r.params.temperature, r.params.top_p, r.params.top_k,
                            r.generator) for r, p in zip(rows, proposals)]
        return self.verifier.verify(items)
