"""The separate topology's step loop: propose on the Draft deployment, verify on the Target.

Per step the loop awaits ``Draft.propose(session, history, K, params)`` and sends the proposal on to
``Target.verify(session, history, proposal, params)``, both over Serve's gRPC transport; it
appends the outcome (a ``VerifyResult``: the accepted draft tokens + one recovered or bonus token,
Leviathan et al. 2023, Algorithm 1) to the request's history, which it owns: the replicas hold only
soft KV state keyed by session and reconcile against the history they receive. Both handles are
pinned to the session's replicas by ``SessionAffinityRouter``. ``release`` goes to both sides when
the request ends, whether it finished, failed or its client went away.

Faults: a draft that fails or does not answer within ``step_timeout_s`` turns the step plain, and
every separate request decodes plain for ``DRAFT_RETRY_S`` before trying the draft again (a dead
Draft costs one step's wait, not a restart's). A Target that does not answer in time raises
``ReplicaLost``: the request migrates (``deployments/pools.py``).
"""

from __future__ import annotations

import asyncio
import contextvars
import dataclasses
import logging
import time
from collections.abc import AsyncIterator

from ray.serve.handle import DeploymentHandle

from deployments.messages import Delta, Resume
from deployments.metrics import RouterMetrics
from specdec_core import Proposal, SamplingParams, VerifyResult
from specdec_core.request import RequestState, resumed_seed

logger = logging.getLogger("ray.serve")

DRAFT_RETRY_S = 5.0  # after a draft failure, separate requests decode plain this long before trying it again


class ReplicaLost(Exception):
    """A replica did not answer in time: presumed dead or restarting."""


class SeparateRequest(RequestState):
    """One separate-topology request: the same history, stopping rules and detokenization as the
    engine's requests (``specdec_core.request``), reported as the engine replicas' deltas."""

    def delta(self) -> Delta:
        return Delta.of(self.output())


class SeparateLoop:
    def __init__(self, draft: DeploymentHandle, target: DeploymentHandle, tokenizer, eos_ids: set[int],
                 max_model_len: int, step_timeout_s: float, metrics: RouterMetrics):
        self._draft, self._target = draft, target
        self._tokenizer, self._eos_ids = tokenizer, eos_ids
        self._max_model_len = max_model_len
        self._step_timeout_s = step_timeout_s
        self._metrics = metrics
        self._draft_down_until = 0.0  # after a draft failure, separate requests skip speculation until then
        self.draft_failures = 0
        self.aborted = 0
        self.background: set[asyncio.Task] = set()

    async def generate(self, request_id: str, prompt_ids: list[int], p: SamplingParams,
                       resume: Resume | None = None) -> AsyncIterator[Delta]:
        """One request's steps. A resumed request (migrated here after its Target died, in an app
        without engine pools) takes a session id of its own, since the dead one's was released, and
        a seed derived from (seed, tokens so far), as the engine's."""
        sid = request_id
        if resume is not None:
            sid = f"{request_id}~{len(resume.output_ids)}"
            if p.seed is not None:
                p = dataclasses.replace(p, seed=resumed_seed(p.seed, len(resume.output_ids)))
        # The proposal comes back here and goes on to the Target by value: two gRPC calls cost less
        # than one chain passing the draft's response through by reference (BENCHMARKS.md, "Serving overhead").
        draft = self._draft.options(session_id=sid, _by_reference=False)
        target = self._target.options(session_id=sid, _by_reference=False)
        req = SeparateRequest(request_id, prompt_ids, p, self._tokenizer, self._eos_ids)
        if resume is not None:
            req.resume(resume.output_ids, resume.sent_chars)
        t0 = time.perf_counter()
        draft_used = draft_failed = False
        first = True
        try:
            while not req.finished:
                # Step 1 is the target's prefill, without a proposal (as in the engine).
                draft_up = time.monotonic() >= self._draft_down_until
                k = 0 if first or not draft_up else req.budget_k(p.num_speculative_tokens, self._max_model_len)
                history = list(req.tokens)
                proposal = None
                if k > 0:
                    draft_used = True
                    proposal = await self._propose(draft, sid, history, k, p)
                    if proposal is None:
                        draft_failed = self._draft_failed(sid, draft_failed)
                outcome = await self._verify(target, sid, history, proposal, p)
                first = False
                req.stats.record_verify(outcome.num_proposed, outcome.num_accepted)
                req.commit(outcome.emitted)
                yield req.delta()
        finally:
            req.stats.latency_s = time.perf_counter() - t0
            self._release_later(sid, draft_used)
            if draft_failed:
                self._metrics.draft_failures.inc()
            if not req.finished:
                self.aborted += 1
            self._log(req, draft_failed)

    async def ping(self) -> None:
        """Does the Target answer (a health probe after it was lost)?"""
        await self._target.options(session_id="__health-probe").where.remote("__health-probe")

    def _draft_failed(self, sid: str, already: bool) -> bool:
        if not already:
            self.draft_failures += 1
        self._draft_down_until = time.monotonic() + DRAFT_RETRY_S
        logger.warning("request %s: draft propose failed; plain verify steps for %.0f s", sid, DRAFT_RETRY_S)
        return True

    async def _propose(self, draft: DeploymentHandle, sid: str, history: list[int], k: int,
                       p: SamplingParams) -> Proposal | None:
        """The draft's proposal, or None when the draft failed or did not answer within ``step_timeout_s``
        (dead, restarting): the step then verifies without one, and the request goes on plain."""
        try:
            return await asyncio.wait_for(draft.propose.remote(sid, history, k, p), self._step_timeout_s)
        except Exception:  # noqa: BLE001 - any draft failure degrades to a plain step
            return None

    async def _verify(self, target: DeploymentHandle, sid: str, history: list[int], proposal: Proposal | None,
                      p: SamplingParams) -> VerifyResult:
        """A verify step. Serve holds a call to a dead replica until its replacement is up (~15 s
        here): a step not answered within ``step_timeout_s`` counts as the Target lost, and the
        request migrates."""
        try:
            return await asyncio.wait_for(target.verify.remote(sid, history, proposal, p), self._step_timeout_s)
        except asyncio.TimeoutError:
            raise ReplicaLost(f"Target did not answer a verify within {self._step_timeout_s} s") from None

    def _release_later(self, session_id: str, draft_used: bool, attempt: int = 0) -> None:
        """Free the session's KV slots on both sides; runs even when the request was cancelled.

        The release runs in its own task with an empty context: no serve request context (so it is
        no child of the possibly cancelled request, whose cancellation Serve propagates to children)
        and no inherited cancel scope. Measured under disconnect storms: a release task created in
        the request's context was occasionally cancelled and leaked the session; if one still is,
        it is re-issued (up to 3 times)."""

        async def release() -> None:
            sides = [self._target] + ([self._draft] if draft_used else [])
            try:
                for handle in sides:
                    try:
                        await handle.options(session_id=session_id).release.remote(session_id)
                    except Exception:
                        logger.exception("release of session %s failed", session_id)
            except asyncio.CancelledError:
                if attempt < 3:
                    logger.warning("release of session %s cancelled; re-issuing", session_id)
                    self._release_later(session_id, draft_used, attempt + 1)
                raise

        task = asyncio.get_running_loop().create_task(release(), context=contextvars.Context())
        self.background.add(task)
        task.add_done_callback(self.background.discard)

    @staticmethod
    def _log(req: SeparateRequest, draft_failed: bool) -> None:
        s, k = req.stats, req.params.num_speculative_tokens
        logger.info(
            "request %s pool=separate mode=%s topology=separate k=%d prompt=%d output=%d proposed=%d "
            "accepted=%d acceptance=%.3f mean_len=%.2f latency=%.3fs finish=%s draft_failed=%s",
            req.request_id, "speculative" if k else "plain", k, s.prompt_tokens, len(req.output_ids), s.proposed,
            s.accepted, s.acceptance_rate, s.mean_acceptance_length, s.latency_s, req.finish_reason or "abort",
            draft_failed,
        )
