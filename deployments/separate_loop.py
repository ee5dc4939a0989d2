"""The separate topology's step loop, in the Router: the engine's own ``Scheduler``
(``specdec_core/scheduler.py``: join and leave at step boundaries, K per row, the draft fallback,
overlapped proposals kept or dropped) driving the ``ChannelExecutor`` (``channel_executor.py``:
propose on the Draft, verify on the Target, over direct channels). One step is schedule -> execute
-> commit, as in-process (``specdec_core.Engine.step``); only the executor differs.

mode=auto means what it means co-located: ``AdaptiveK`` (hysteresis, probes, the regret guard,
K=0 when speculation does not pay), here priced for the separate topology (its hops, and the
overlap the executor runs). A request's outputs reach its caller through its own queue, coalesced
per ``stream_interval_s`` as the engine replicas' (``specdec_core.async_engine.coalesced``).

Faults: a failed draft turns a request's steps plain for ``DRAFT_RETRY_S``; a Target that is gone
fails its requests with ``ReplicaLost``: they migrate (``deployments/pools.py``).
"""

from __future__ import annotations

import asyncio
import contextvars
import dataclasses
import logging
import time
from collections.abc import AsyncIterator

from ray.serve.handle import DeploymentHandle

from deployments.channel_executor import DRAFT_RETRY_S, ChannelExecutor, OverlapPolicy
from deployments.messages import Delta, Resume
from deployments.metrics import RouterMetrics, log_request
from specdec_core import RequestOutput, SamplingParams
from specdec_core.adaptive import AdaptiveK
from specdec_core.async_engine import coalesced
from specdec_core.request import resumed_seed
from specdec_core.scheduler import ScheduledRequest, Scheduler, StepPlan

logger = logging.getLogger("ray.serve")

UNBOUNDED = 1 << 30  # the loop admits every request at once: the Target replicas bound their own slots


class SeparateLoop:
    def __init__(self, draft: DeploymentHandle, target: DeploymentHandle, tokenizer, eos_ids: set[int],
                 max_model_len: int, step_timeout_s: float, adaptive: AdaptiveK, overlap: OverlapPolicy,
                 metrics: RouterMetrics):
        self._tokenizer, self._eos_ids = tokenizer, eos_ids
        self.scheduler = Scheduler(UNBOUNDED, max_model_len, speculative=True, adaptive=adaptive,
                                   draft_retry_s=DRAFT_RETRY_S)
        self.executor = ChannelExecutor(draft, target, max_model_len, step_timeout_s, overlap)
        self._metrics = metrics
        self._streams: dict[str, asyncio.Queue] = {}  # session id -> its request's outputs (or an error)
        self._task: asyncio.Task | None = None
        self.draft_failures = 0
        self.aborted = 0
        self.steps = 0

    @property
    def overlap(self):
        return self.executor.overlap

    @property
    def background(self) -> set[asyncio.Task]:
        return self.executor.background

    async def ping(self) -> None:
        await self.executor.ping()

    async def generate(self, request_id: str, prompt_ids: list[int], p: SamplingParams,
                       stream_interval_s: float | None, resume: Resume | None = None) -> AsyncIterator[Delta]:
        """One request's deltas, one per ``stream_interval_s`` (None: one at the end). A resumed
        request (migrated here after its Target died, in an app without engine pools) takes a
        session id of its own, since the dead one's was released, and a seed derived from (seed,
        tokens so far), as the engine's."""
        sid = request_id
        if resume is not None:
            sid = f"{request_id}~{len(resume.output_ids)}"
            if p.seed is not None:
                p = dataclasses.replace(p, seed=resumed_seed(p.seed, len(resume.output_ids)))
        req = ScheduledRequest(sid, prompt_ids, p, self._tokenizer, self._eos_ids)
        if resume is not None:
            req.resume(resume.output_ids, resume.sent_chars)
        if not await self.executor.attach(sid, sid, p.num_speculative_tokens > 0):
            self._draft_failed(req)
        queue: asyncio.Queue = asyncio.Queue()
        self._streams[sid] = queue
        self.scheduler.add(req)
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._run(), context=contextvars.Context())
        t0 = time.perf_counter()
        try:
            async for out in coalesced(self._outputs(queue), stream_interval_s):
                yield Delta.of(out)
        finally:
            self._streams.pop(sid, None)
            if not req.finished:
                self.aborted += 1
                self.scheduler.abort(sid)
            if req.draft_failed:
                self._metrics.draft_failures.inc()
            log_request(logger, request_id, "separate", p.num_speculative_tokens, "separate", len(prompt_ids),
                        req.stats, time.perf_counter() - t0, req.finish_reason or "abort",
                        draft_failed=req.draft_failed)

    @staticmethod
    async def _outputs(queue: asyncio.Queue) -> AsyncIterator[RequestOutput]:
        while True:
            item = await queue.get()
            if isinstance(item, BaseException):
                raise item
            yield item
            if item.finished:
                return

    async def _run(self) -> None:
        """Steps while any request is in the batch (the task ends when it is empty)."""
        while self.scheduler.has_work():
            plan = self.scheduler.schedule(UNBOUNDED)
            for req in plan.aborted:
                self.executor.release(req.request_id)
            if not plan.rows:
                continue
            self.steps += 1
            failed_before = sum(r.draft_failed for r in plan.decode)
            try:
                result = await self.executor.execute(plan)
                outputs = self.scheduler.commit(plan, result)
                self.draft_failures += sum(r.draft_failed for r in plan.decode) - failed_before
                self._deliver(plan, outputs)
            except Exception as exc:  # a bug must fail the requests, not hang them
                logger.exception("separate step failed")
                for req in plan.rows:
                    self.scheduler.fail(req, exc)
                    self._send(req.request_id, exc)
            for req in plan.rows:
                if req.finished:
                    self.executor.release(req.request_id)

    def _deliver(self, plan: StepPlan, outputs: list[RequestOutput]) -> None:
        """Each output to its request's queue; a row that failed gets its error instead (ReplicaLost migrates)."""
        errors = {r.request_id: r.error for r in plan.rows if r.error is not None}
        for out in outputs:
            self._send(out.request_id, errors.get(out.request_id, out))

    def _send(self, session_id: str, item: RequestOutput | BaseException) -> None:
        queue = self._streams.get(session_id)
        if queue is not None:
            queue.put_nowait(item)

    def _draft_failed(self, req: ScheduledRequest) -> None:
        self.draft_failures += 1
        req.draft_failed = True
        req.draft_retry_at = self.scheduler.clock() + DRAFT_RETRY_S
