"""The scheduler: which requests run a step, at what K, and what the step's results do to them.

One scheduler serves both topologies. A step is schedule -> execute -> commit (as vLLM's
``EngineCore.step``): ``Scheduler.schedule`` admits waiting requests (their prefill pass emits the
first token), takes aborts and chooses each running request's K (K=0 is plain decoding); an
executor runs the forwards (``executor.LocalExecutor`` in process, the separate topology's channels
in ``deployments/channel_executor.py``); ``Scheduler.commit`` applies the verified tokens. Requests
join and leave only at step boundaries. Pure and synchronous: no I/O, no threads of its own (aborts
may come from another thread), the clock passed in.

Vocabulary (Leviathan et al. 2023, Algorithm 1): q is the draft's distribution, p the target's; a
verify keeps the *accepted* draft tokens and adds one *recovered* token (at the first rejection) or
one *bonus* token (all K accepted). Overlap (PEARL's post-verify, Liu et al. 2024), an executor's
capability: while the target verifies proposal P the draft proposes the next round O after P; when
the target accepts all of P the step commits P without its bonus token and O is what the next
verify judges (its first token against the distribution the bonus came from: lossless).

The K policy sits behind one seam: a request's own K (fixed), or ``AdaptiveK`` (mode=auto) priced
for the executor's topology; a failed draft turns its requests' steps plain (for ``draft_retry_s``).
"""

from __future__ import annotations

import math
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from specdec_core.acceptance import ProposalCoverage, TrafficClass
from specdec_core.adaptive import REPRICE_EVERY, AdaptiveK, KState, Phase
from specdec_core.cost_view import CONTEXT_BUCKET
from specdec_core.decode_clock import DecodeClock
from specdec_core.proposers import Proposal
from specdec_core.regret import Regret
from specdec_core.request import RequestOutput, RequestState
from specdec_core.stats import StepTiming
from specdec_core.step_planner import StepBudget
from specdec_core.verifier import VerifyResult

NO_PROPOSAL = Proposal([], None)


def step_context(rows: Sequence[RequestState]) -> int:
    """The context a decode step of ``rows`` is priced and learnt at: their mean, rounded up. Attention
    reads each row's own cache, so a step costs the calibration's slope per token and row times the sum of
    their contexts (``StepCosts.at_context``), which the mean prices exactly. Priced at the longest row,
    a steady batch 8 (rows from just admitted to nearly done) ran its plain steps at 0.87x their price and
    the drain of the same cell (its last, long rows) at 1.11-1.25x, and the drift of their shared bucket
    swung between the two."""
    return -(-sum(len(r.tokens) for r in rows) // len(rows))


class ScheduledRequest(RequestState):
    """A request's state plus what scheduling needs: its random stream and its speculation state."""

    def __init__(self, request_id, prompt_ids, params, tokenizer, eos_ids, generator=None):
        super().__init__(request_id, prompt_ids, params, tokenizer, eos_ids)
        self.generator = generator  # the in-process sampler's stream (None where the replicas sample)
        self.draft_failed = False
        self.draft_retry_at = -math.inf  # plain steps until then, after a draft failure
        self.k_state: KState | None = None  # adaptive K of this request
        self.traffic_class: TrafficClass | None = None  # its acceptance class, once adaptive K asks
        self.draft_seen = 0  # history length the draft has fed (its proposals count until rejected)
        self.regret = Regret()  # adaptive K's guard: what its speculative steps cost against plain ones
        self.carried: Proposal | None = None  # an overlapped proposal: what this request's next verify judges
        self.plain_run = 0  # consecutive decode steps without a proposal (a budgeted row's probe clock)
        self.coverage = ProposalCoverage()  # how much of the K it asked its proposer for came back
        self.error: BaseException | None = None  # why its step failed, for the caller to raise

    @property
    def draft_catch_up(self) -> int:
        """Tokens the draft must feed before it can propose: one after a speculative step (the
        recovered or bonus token), every token emitted since then after plain steps."""
        return max(1, len(self.tokens) - self.draft_seen)


@dataclass(frozen=True)
class StepPlan:
    """What one step runs: the admitted requests' prefill, the running ones' decode at their K."""

    prefill: tuple[ScheduledRequest, ...] = ()
    decode: tuple[ScheduledRequest, ...] = ()
    ks: tuple[int, ...] = ()  # per decode row: draft tokens to propose (0: plain; a carried proposal's length)
    aborted: tuple[ScheduledRequest, ...] = ()  # left at this boundary: the executor frees their state

    @property
    def rows(self) -> tuple[ScheduledRequest, ...]:
        return self.prefill + self.decode

    def only(self, req: ScheduledRequest) -> StepPlan:
        """This plan for one of its requests alone (failure isolation)."""
        if req in self.prefill:
            return StepPlan(prefill=(req,))
        return StepPlan(decode=(req,), ks=(self.ks[self.decode.index(req)],))


@dataclass
class StepResult:
    """What an executor made of a plan."""

    proposals: list[Proposal]  # per decode row: the proposal verified (NO_PROPOSAL: a plain step)
    verified: list[VerifyResult | BaseException]  # per row of plan.rows, or why that row failed
    draft_failed: set[int] = field(default_factory=set)  # decode rows whose draft failed this step
    ahead: dict[int, Proposal] = field(default_factory=dict)  # decode rows: the next round, proposed meanwhile
    timing: StepTiming = field(default_factory=StepTiming)


@dataclass
class _PlainPlan:
    """A budgeted plan that ran every row plain, what it was made for, and the steps it has stood."""

    key: tuple  # the rows, what each keeps outside the plan (``fixed``), the context bucket
    budget: StepBudget
    steps: int = 1


class Scheduler:
    def __init__(self, max_batch_size: int, max_model_len: int, speculative: bool,
                 adaptive: AdaptiveK | None = None, draft_retry_s: float = math.inf,
                 clock: Callable[[], float] = time.monotonic):
        self.max_batch_size = max_batch_size
        self.max_model_len = max_model_len
        self.speculative = speculative  # an executor that can propose
        self.adaptive = adaptive
        self.draft_retry_s = draft_retry_s
        self.clock = clock
        self._incoming: deque[ScheduledRequest] = deque()
        self._waiting: deque[ScheduledRequest] = deque()
        self.running: list[ScheduledRequest] = []
        self._aborts: set[str] = set()
        self._lock = threading.Lock()
        self.budget: StepBudget | None = None  # the last step's budgeted plan (None: not planned)
        self._plain_plan: _PlainPlan | None = None  # the last budgeted plan, while it stands plain
        self.decode_clock = DecodeClock()  # the decode rows' share of a forward that carried prefills

    # ---- requests ----------------------------------------------------------------------------

    def add(self, req: ScheduledRequest) -> None:
        """Queue a request (thread-safe); it joins at the next step boundary."""
        self._incoming.append(req)

    def abort(self, request_id: str) -> None:
        """Thread-safe; the request finishes with reason "abort" at the next step boundary."""
        with self._lock:
            self._aborts.add(request_id)

    def has_work(self) -> bool:
        return bool(self._incoming or self._waiting or self.running)

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self._incoming) + len(self._waiting)

    # ---- schedule ------------------------------------------------------------------------------

    def schedule(self, free_slots: int, slot_of: Callable[[str], int] | None = None) -> StepPlan:
        """The next step: aborts taken, running requests (in ``slot_of`` order: a run of consecutive
        slots is read as a view, not gathered) at their K, waiting ones admitted into free slots."""
        while self._incoming:
            self._waiting.append(self._incoming.popleft())
        aborted = self._take_aborts()
        decode = sorted(self.running, key=lambda r: slot_of(r.request_id)) if slot_of else list(self.running)
        admitted = []
        while self._waiting and len(self.running) < self.max_batch_size and free_slots > 0:
            req = self._waiting.popleft()
            self.running.append(req)
            admitted.append(req)
            free_slots -= 1
        return StepPlan(tuple(admitted), tuple(decode), tuple(self._ks(decode)), tuple(aborted))

    def _take_aborts(self) -> list[ScheduledRequest]:
        with self._lock:
            aborts, self._aborts = self._aborts, set()
        if not aborts:
            return []
        gone = [r for r in list(self._waiting) + self.running if r.request_id in aborts]
        for req in gone:
            req.finish("abort")
        self._waiting = deque(r for r in self._waiting if not r.finished)
        self.running = [r for r in self.running if not r.finished]
        return gone

    def _ks(self, rows: list[ScheduledRequest]) -> list[int]:
        batch = len(rows)
        self.budget = None  # set again only by a budgeted plan of these rows
        if self.adaptive is not None and self.adaptive.budgeted:
            return self._budgeted_ks(rows)
        chosen = [self._choose_k(r, batch) for r in rows]
        if self.adaptive is None:
            return chosen
        adaptive = [r.params.adaptive_k and r.carried is None for r in rows]
        ks = chosen
        now = self.clock()
        if batch > 1 and any(ks):
            ks = self.adaptive.batch_ks(
                ks, adaptive, [self._lift_cap(r, now) if on and not k else 0 for r, on, k in zip(rows, adaptive, ks)],
                [self._traffic_class(r) for r in rows],
                [(r.stats.accepted, sum(r.stats.proposed_per_position), r.params.class_acceptance) for r in rows],
                step_context(rows),
            )
        batch_ks = ks
        if any(ks) and all(on for on, k in zip(adaptive, ks) if k) and self.adaptive.reference_due(batch):
            ks = [0] * batch  # the regret guard's reference step (adaptive.py): measured plain, once
        self._count_plain_causes(rows, adaptive, chosen, batch_ks, ks, now)
        return ks

    def _lift_cap(self, req: ScheduledRequest, now: float) -> int:
        """The K a step may lift an adaptive row to that priced itself plain (``AdaptiveK.batch_ks``): at most the
        K its regret guard left it (a stopped row: the K that lost last), 0 while its draft waits after a
        failure. A stopped row left plain in a speculating batch takes a whole speculative step per token."""
        if now < req.draft_retry_at or req.k_state is None:
            return 0
        return req.budget_k(min(req.params.num_speculative_tokens, req.regret.k_cap or math.inf), self.max_model_len)

    def _count_plain_causes(self, rows: list[ScheduledRequest], adaptive: list[bool], chosen: list[int],
                            batch_ks: list[int], ks: list[int], now: float) -> None:
        """What set each adaptive row's K to 0 this step (``RequestStats.plain_by_cause``): its own price,
        the batch's, the regret guard's reference step, or its guard having stopped it. The replica's
        decline is what the router learns (``LoadLessons.declined``); this says which part of it declined."""
        for req, on, first, after_batch, k in zip(rows, adaptive, chosen, batch_ks, ks):
            if not on or k or req.params.num_speculative_tokens == 0:
                continue
            if now < req.draft_retry_at:
                cause = "draft"
            elif req.k_state is not None and req.k_state.phase is Phase.STOPPED:
                cause = "stopped"
            else:
                cause = "priced" if not first else "batch" if not after_batch else "reference"
            req.stats.plain_by_cause[cause] = req.stats.plain_by_cause.get(cause, 0) + 1

    def _budgeted_ks(self, rows: list[ScheduledRequest]) -> list[int]:
        """Every adaptive row's K from one plan for the batch (``AdaptiveK.plan_budget``); the other
        rows keep theirs (fixed K, an overlapped proposal, plain while a failed draft waits)."""
        planned = [self._plannable(r) for r in rows]
        fixed = [None if on else self._choose_k(r, len(rows)) for r, on in zip(rows, planned)]
        if not any(planned):
            return fixed
        if self.adaptive.reference_due(len(rows)) and not any(fixed):
            return [0] * len(rows)  # the drift's reference: one measured plain step (adaptive.py)
        context_len = step_context(rows)
        key = (tuple(r.request_id for r in rows), tuple(fixed), -(-context_len // CONTEXT_BUCKET))
        if self._plain_plan_stands(key, rows):
            self._plain_plan.steps += 1
            self.budget = self._plain_plan.budget
            return list(self.budget.ks)
        self.budget = self.adaptive.plan_budget(
            [self._traffic_class(r) for r in rows],
            [(r.stats.accepted_per_position, r.stats.proposed_per_position, r.params.class_acceptance) for r in rows],
            [r.budget_k(r.params.num_speculative_tokens, self.max_model_len) for r in rows],
            fixed, context_len, [r.plain_run for r in rows],
            [r.draft_catch_up for r in rows], [r.params.max_new_tokens - len(r.output_ids) for r in rows],
            [r.coverage for r in rows],
        )
        self._plain_plan = None if any(self.budget.ks) else _PlainPlan(key, self.budget)
        return list(self.budget.ks)

    def _plain_plan_stands(self, key: tuple, rows: list[ScheduledRequest]) -> bool:
        """Does the last plan, plain for every row, stand for these rows this step? While a batch runs plain
        its rows judge nothing and their drafts fall further behind: nothing a plan reads moves towards
        speculation but the rows, their context bucket, a probe coming due, and (slowly) the drift. So it
        stands while those stay put, re-planned every ``REPRICE_EVERY`` steps as a plain request is
        re-priced (``AdaptiveK._price``): a plan was ~0.3 ms at batch 4-8, 3-4% of a plain step there."""
        standing = self._plain_plan
        return (standing is not None and standing.key == key and standing.steps < REPRICE_EVERY
                and not any(r.plain_run == self.adaptive.probe_every for r in rows))

    def _plannable(self, req: ScheduledRequest) -> bool:
        return (req.params.adaptive_k and req.params.num_speculative_tokens > 0 and req.carried is None
                and self.speculative and self.clock() >= req.draft_retry_at)

    def _choose_k(self, req: ScheduledRequest, batch: int) -> int:
        if req.carried is not None:  # proposed during the last verify: this step judges it
            return len(req.carried.token_ids)
        if not self.speculative or self.clock() < req.draft_retry_at:
            return 0
        k = req.params.num_speculative_tokens
        if req.params.adaptive_k and self.adaptive is not None and k > 0:
            k = min(k, req.regret.k_cap or k)
            req.k_state = self.adaptive.choose(
                req.k_state, self._traffic_class(req), req.stats.accepted, sum(req.stats.proposed_per_position),
                batch, k, remaining_tokens=req.params.max_new_tokens - len(req.output_ids),
                catch_up_tokens=req.draft_catch_up, context_len=len(req.tokens),
                class_estimate=req.params.class_acceptance,
            )
            k = req.k_state.k
        return req.budget_k(k, self.max_model_len)

    # ---- commit --------------------------------------------------------------------------------

    def commit(self, plan: StepPlan, result: StepResult, stream_text: bool = True) -> list[RequestOutput]:
        """Apply a step's results; the outputs of its rows and its aborts. A row whose result is an
        exception finishes with "error" (its ``error`` says why). Finished requests leave the batch:
        the caller frees their executor state."""
        timing = self._split_prefills(plan, result)
        n_prefill = len(plan.prefill)
        for req, res in zip(plan.prefill, result.verified):
            if self._verified(req, res, NO_PROPOSAL, None):
                req.stats.prefill_s = req.stats.first_token_s = time.perf_counter() - req.arrival
        if plan.decode:
            self._commit_decode(plan, result, result.verified[n_prefill:])
        sampled = sum(1 for r in plan.decode if r.params.temperature > 0)
        for req in plan.decode:
            req.stats.decode_s += timing.total_s - timing.prefill_s
            req.stats.prefill_wait_s += timing.prefill_s
            req.stats.decode_steps += 1
            req.stats.decode_batch_rows += len(plan.decode)
            req.stats.decode_sampled_rows += sampled
        self.running = [r for r in self.running if not r.finished]
        return [r.output(stream_text) for r in plan.aborted + plan.rows]

    def _split_prefills(self, plan: StepPlan, result: StepResult) -> StepTiming:
        """The executor timed one verify forward for the step's prefill and decode rows (``verify_s``):
        the decode rows' share is what their verify costs alone (``DecodeClock``), the prefills' the rest.
        A forward of decode rows alone teaches the clock."""
        timing = result.timing
        timing.prefill_rows = len(plan.prefill)
        if not plan.decode:
            timing.prefill_s, timing.verify_s = timing.verify_s, 0.0
            return timing
        rows = len(plan.decode)
        tokens = rows + sum(len(p.token_ids) for p in result.proposals)
        if not plan.prefill:
            self.decode_clock.observe(rows, tokens, timing.verify_s)
            return timing
        alone = self.decode_clock.price(rows, tokens)
        decode_s = timing.verify_s if alone is None else min(timing.verify_s, alone)
        timing.prefill_s, timing.verify_s = timing.verify_s - decode_s, decode_s
        return timing

    def fail(self, req: ScheduledRequest, error: BaseException) -> None:
        """The request fails alone (its step failed without it committing): it leaves the batch."""
        req.error = error
        req.carried = None
        req.finish("error")
        self.running = [r for r in self.running if r is not req]

    def _verified(self, req: ScheduledRequest, res, proposal: Proposal, ahead: Proposal | None) -> bool:
        """Commit one row's verify; False if it failed."""
        if isinstance(res, BaseException):
            self.fail(req, res)
            return False
        req.stats.record_verify(res.num_proposed, res.num_accepted)
        if self.adaptive is not None and res.num_proposed:
            self.adaptive.observe(self._traffic_class(req), res.num_proposed, res.num_accepted)
        emitted = res.emitted
        req.carried = None
        if proposal.token_ids:
            req.draft_seen = len(req.tokens) + len(proposal.token_ids)
            if ahead is not None and res.num_accepted == res.num_proposed:
                # All of P accepted: commit P without the bonus; the overlapped O is judged next.
                emitted, req.carried = emitted[:-1], ahead
        req.commit(emitted)
        if req.finished:
            req.carried = None
        return True

    def _commit_decode(self, plan: StepPlan, result: StepResult, verified: list) -> None:
        rows, timing = plan.decode, result.timing
        now = self.clock()
        for i in result.draft_failed:
            rows[i].draft_failed = True
            rows[i].draft_retry_at = now + self.draft_retry_s
        # What the draft fed before proposing: the proposing rows' catch-up (a plain row's lag costs this step
        # nothing; counted, a mixed plan's plain row kept every step of its batch from the drift)
        catch_up = max((r.draft_catch_up for r, k in zip(rows, plan.ks) if k), default=1)
        before = [len(r.output_ids) for r in rows]
        context_len = step_context(rows)  # what the step was priced at
        for i, (req, res, prop) in enumerate(zip(rows, verified, result.proposals)):
            if self.budget is not None and plan.ks[i] and req.carried is None and i not in result.draft_failed:
                # What only a budgeted plan reads: what its proposer delivered of a fresh ask (a carried
                # proposal was asked for at the length it has; a failed draft is no answer).
                req.coverage.record(plan.ks[i], min(plan.ks[i], len(prop.token_ids)))
            self._verified(req, res, prop, result.ahead.get(i))
            req.plain_run = 0 if prop.token_ids else req.plain_run + 1
        step_s = timing.propose_s + timing.verify_s
        proposed = {len(p.token_ids) for p in result.proposals}
        timing.batch = len(rows)
        timing.speculative_rows = sum(1 for p in result.proposals if p.token_ids)
        timing.k = max(proposed)
        timing.ks = tuple(len(p.token_ids) for p in result.proposals)
        timing.draft_tokens = sum(timing.ks)
        timing.context_len = context_len
        if self.budget is not None and len(self.budget.ks) == len(rows):
            timing.planned_speedup = self.budget.predicted_speedup
        timing.emitted = sum(len(r.output_ids) - n0 for r, n0 in zip(rows, before))
        if self.adaptive is None:
            return
        # A draft's catch-up prefill (the prompt, or what plain steps emitted) is not a step cost: it
        # was priced when the row chose to speculate (``AdaptiveK``: it must pay for itself), so it is
        # neither regret (a long prompt's first speculative step would stop the request at once) nor drift.
        # Plain steps feed no draft: they are always step costs.
        if plan.prefill:  # its decode share was priced (``DecodeClock``), not measured: it teaches nothing
            return
        classes = [self._traffic_class(r) for r in rows]
        if catch_up <= 2:
            self._account_regret(rows, result.proposals, before, step_s, classes, context_len)
        # Steps whose rows all proposed K tokens (or none), or ran a budgeted plan, teach adaptive K how
        # far real steps run from the calibration.
        if self.budget is not None and catch_up <= 2 and len(self.budget.ks) == len(rows):
            self.adaptive.observe_ragged_step(classes, context_len, list(timing.ks), step_s)
        elif len(proposed) == 1 and (proposed == {0} or catch_up <= 2):
            self.adaptive.observe_step(classes, context_len, proposed.pop(), step_s)

    def _account_regret(self, rows, proposals: list[Proposal], before: list[int], step_s: float,
                        classes: list[TrafficClass], context_len: int) -> None:
        """Charge each adaptive row that speculated at its own K against plain steps of this batch for the
        tokens it emitted, at its share of the step (``Regret.charge``); a row over its budget decodes plain
        to its end (``adaptive.stop``). A row the batch lifted from its plain price (``AdaptiveK.batch_ks``)
        is not charged: the batch chose its K."""
        per_row = sum(len(p.token_ids) for p in proposals) / len(rows)  # the step's draft tokens per row
        plain_step = None
        for req, prop, n0 in zip(rows, proposals, before):
            if prop.token_ids and req.params.adaptive_k and req.k_state is not None and req.k_state.k:
                if plain_step is None:  # the step's rows as its plain steps were measured: once a step
                    plain_step = self.adaptive.plain_step_time(classes, context_len)
                emitted = len(req.output_ids) - n0
                if req.regret.charge(step_s, emitted, len(prop.token_ids), plain_step, len(req.output_ids),
                                     share=len(prop.token_ids) / per_row):
                    req.k_state = req.regret.trip(req.k_state)

    def _traffic_class(self, req: ScheduledRequest) -> TrafficClass:
        if req.traffic_class is None:  # fixed for the request's life; asked several times a step
            req.traffic_class = self.adaptive.traffic_class(req.params.temperature, req.params.domain)
        return req.traffic_class
