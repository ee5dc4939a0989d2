"""The separate topology's step loop: one batched step for every separate request, proposals from
the Draft deployment, verification on the Target (Leviathan et al. 2023, Algorithm 1; q is the
draft's distribution, p the target's; a verify emits the accepted draft tokens and one recovered or
bonus token).

Continuous batching: requests join and leave at step boundaries, and each step sends one message
to each Draft and each Target replica that holds a session of the batch, over direct channels
(``deployments/channel.py``; a session-pinned Serve call finds the replica, ``SessionAffinityRouter``).
Messages carry the change of each session's context, not its history (``deployments/contexts.py``).
The loop owns every request's history; the replicas hold soft KV state that they reconcile against
the context they rebuild. ``release`` goes to both sides when a request leaves, whether it
finished, failed or its client went away.

Overlap (PEARL's post-verify, Liu et al. 2024): while the Target verifies a proposal P, the Draft
already proposes the next round O from the optimistic context history + P. If the target accepts
all of P, the step commits P without its bonus token and O is the next round's proposal, whose
first token the next verify judges against the same target distribution the bonus would have been
drawn from: lossless, and the draft's time hides behind the verify. Otherwise the step commits as
usual and O is dropped (the Draft's cache reconciles against the next context). Each round,
``round_policy`` (the router's ``RouteState.separate_round``) gives a request its K (an adaptive one's
re-chosen from the cost model) and whether to overlap it: where the kept rounds hide more draft time
than the dropped ones cost.

Faults: a draft that fails or does not answer within ``step_timeout_s`` (a dead Draft closes its
channel: at once) turns its requests' steps plain, and every separate request decodes plain for
``DRAFT_RETRY_S`` before it looks for a draft again. A Target that is gone or does not answer in
time raises ``ReplicaLost`` in its requests: they migrate (``deployments/pools.py``).
"""

from __future__ import annotations

import asyncio
import collections
import contextvars
import dataclasses
import logging
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

from ray.serve.handle import DeploymentHandle

from deployments.channel import Channel, ChannelCallError, ChannelClosed, ChannelMethods
from deployments.contexts import SentContexts
from deployments.messages import (
    DRAFT_METHODS,
    TARGET_METHODS,
    Delta,
    ItemFailed,
    ProposeStepItem,
    Resume,
    Resync,
    VerifyStepItem,
)
from deployments.metrics import RouterMetrics
from deployments.session_router import pinned_gather
from specdec_core import Proposal, RequestOutput, SamplingParams
from specdec_core.request import RequestState, resumed_seed
from specdec_core.stats import RequestStats

logger = logging.getLogger("ray.serve")

# (batch, the request's stats, its parameters, its context length) -> (K of its next round, overlap it?)
RoundPolicy = Callable[[int, RequestStats, SamplingParams, int], tuple[int, bool]]
DRAFT_RETRY_S = 5.0  # after a draft failure, separate requests decode plain this long before trying it again


class ReplicaLost(Exception):
    """A replica did not answer in time: presumed dead or restarting."""


class SeparateRequest(RequestState):
    """One separate-topology request: the same history, stopping rules and detokenization as the
    engine's requests (``specdec_core.request``), reported as the engine replicas' deltas."""

    def delta(self) -> Delta:
        return Delta.of(self.output())


@dataclass(eq=False)
class _Active:
    """A request in the loop's batch."""

    req: SeparateRequest
    session_id: str
    target: Channel | None = None
    draft: Channel | None = None  # None until found, and after a draft failure
    draft_lookup: asyncio.Task | None = None
    proposal: Proposal | None = None  # the overlapped proposal for the next verify
    round_k: int = 0  # K of this round (adaptive requests: re-chosen every round)
    overlap: bool = False  # propose the next round during this round's verify
    prefilled: bool = False
    left: bool = False  # the client went away: leave at the next step boundary
    draft_used: bool = False
    draft_failed: bool = False
    stream_interval_s: float | None = None  # as the engine replicas': None, one message at the end
    outbox: collections.deque = field(default_factory=collections.deque)  # RequestOutput, then maybe an error
    ready: asyncio.Event = field(default_factory=asyncio.Event)
    sent_at: float = float("-inf")  # the first tokens go out at once (time to first token)

    def send(self, item: RequestOutput | BaseException) -> None:
        """Queue a step's output for the client; wake it when the output is final or the stream
        interval has passed (steps within an interval go out as one message, as the engine replicas')."""
        self.outbox.append(item)
        now = time.perf_counter()
        if (isinstance(item, BaseException) or item.finished
                or (self.stream_interval_s is not None and now - self.sent_at >= self.stream_interval_s)):
            self.sent_at = now
            self.ready.set()

    def k(self, max_len: int, ahead: int = 0) -> int:
        """This round's K for a proposal after the history and ``ahead`` more tokens (budget and context left)."""
        return self.req.budget_k(self.round_k, max_len, ahead)


@dataclass
class OverlapStats:
    proposed: int = 0  # overlapped proposals made
    kept: int = 0  # ... that became the next round's proposal (the target accepted all it verified)


class SeparateLoop:
    def __init__(self, draft: DeploymentHandle, target: DeploymentHandle, tokenizer, eos_ids: set[int],
                 max_model_len: int, step_timeout_s: float, round_policy: RoundPolicy, metrics: RouterMetrics):
        self._draft, self._target = draft, target
        self._tokenizer, self._eos_ids = tokenizer, eos_ids
        self._max_model_len = max_model_len
        self._step_timeout_s = step_timeout_s
        self._round_policy = round_policy
        self._metrics = metrics
        self._batch: list[_Active] = []
        self._task: asyncio.Task | None = None
        self._channels: dict[str, Channel] = {}  # replica id -> open channel
        self._sent: dict[str, SentContexts] = collections.defaultdict(SentContexts)  # replica id -> ...
        self._draft_down_until = 0.0  # after a draft failure, separate requests skip speculation until then
        self.draft_failures = 0
        self.aborted = 0
        self.steps = 0
        self.overlap = OverlapStats()
        self.background: set[asyncio.Task] = set()

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
        req = SeparateRequest(request_id, prompt_ids, p, self._tokenizer, self._eos_ids)
        if resume is not None:
            req.resume(resume.output_ids, resume.sent_chars)
        a = _Active(req, sid, stream_interval_s=stream_interval_s)
        draft_up = p.num_speculative_tokens and time.monotonic() >= self._draft_down_until
        # Both replicas are looked up at once: the first proposal step finds its draft ready.
        target, _ = await asyncio.gather(self._connect(self._target, TARGET_METHODS, sid),
                                         self._find_draft(a) if draft_up else asyncio.sleep(0),
                                         return_exceptions=True)
        if isinstance(target, BaseException):
            raise ReplicaLost(f"no Target channel: {target}") from target
        a.target = target
        self._batch.append(a)
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._run(), context=contextvars.Context())
        try:
            while True:
                await a.ready.wait()
                a.ready.clear()
                items = list(a.outbox)
                a.outbox.clear()
                outputs = [x for x in items if isinstance(x, RequestOutput)]
                if outputs:  # steps the client has not read yet go out as one delta
                    merged = outputs[0]
                    for out in outputs[1:]:
                        merged = merged.merged(out)
                    yield Delta.of(merged)
                    if merged.finished:
                        return
                if len(outputs) < len(items):
                    raise items[-1]
        finally:
            a.left = True
            if not req.finished:
                self.aborted += 1
            if a.draft_failed:
                self._metrics.draft_failures.inc()
            self._log(req, a.draft_failed)

    async def ping(self) -> None:
        """Does the Target answer (a health probe after it was lost)?"""
        await self._target.options(session_id="__health-probe").where.remote("__health-probe")

    async def _run(self) -> None:
        """Steps while any request is in the batch (the task ends when it is empty)."""
        while True:
            for a in [a for a in self._batch if a.left or a.req.finished]:
                self._leave(a)
            if not self._batch:
                return
            batch = list(self._batch)
            try:
                await self._step(batch)
            except Exception as exc:  # a bug must fail the requests, not hang them
                logger.exception("separate step failed")
                for a in batch:
                    self._fail(a, exc)

    async def _step(self, batch: list[_Active]) -> None:
        self.steps += 1
        for a in batch:
            a.round_k, a.overlap = self._round_policy(len(batch), a.req.stats, a.req.params, len(a.req.tokens))
        fresh = await self._propose([(a, a.k(self._max_model_len)) for a in batch if self._wants_draft(a)])
        proposals = {a: a.proposal for a in batch if a.proposal is not None} | fresh
        ahead = [(a, a.k(self._max_model_len, len(prop.token_ids))) for a, prop in proposals.items() if a.overlap]
        outcomes, optimistic = await asyncio.gather(self._verify(batch, proposals),
                                                    self._propose([x for x in ahead if x[1] > 0], proposals))
        self.overlap.proposed += len(optimistic)
        for a in batch:
            a.proposal = None
            res = outcomes[a]
            if isinstance(res, BaseException):
                self._fail(a, res)
                continue
            if not a.prefilled:
                a.prefilled = True
                a.req.stats.first_token_s = time.perf_counter() - a.req.arrival
            a.req.stats.record_verify(res.num_proposed, res.num_accepted)
            emitted = res.emitted
            if res.num_proposed and res.num_accepted == res.num_proposed and a in optimistic:
                # All of P accepted: commit P without the bonus; O is judged next, against the
                # same target distribution the bonus came from.
                emitted, a.proposal = emitted[:-1], optimistic[a]
                self.overlap.kept += 1
            a.req.commit(emitted)
            a.send(a.req.output())
            if a.req.finished:
                a.proposal = None

    def _wants_draft(self, a: _Active) -> bool:
        """Does this request get a fresh proposal before this step's verify?"""
        if a.left or not a.prefilled or a.proposal is not None or a.k(self._max_model_len) == 0:
            return False
        if time.monotonic() < self._draft_down_until:
            return False
        if a.draft is None or a.draft.closed:
            a.draft = None
            self._find_draft_later(a)
            return False
        return True

    async def _propose(self, wanted: list[tuple[_Active, int]],
                       after: dict[_Active, Proposal] | None = None) -> dict[_Active, Proposal]:
        """Proposals of K tokens for each (request, K), after its history (and ``after`` it: the
        overlapped round), one message per Draft replica. A request whose draft fails is left out."""
        ks = {a: k for a, k in wanted if a.draft is not None and not a.draft.closed}
        if not ks or time.monotonic() < self._draft_down_until:
            return {}

        def item(ch: Channel, a: _Active) -> ProposeStepItem:
            context = a.req.tokens + (after[a].token_ids if after else [])
            ctx = self._sent[ch.address.replica].change(a.session_id, context, len(a.req.tokens), a.req.params)
            return ProposeStepItem(ctx, ks[a])

        out: dict[_Active, Proposal] = {}
        for a, r in await self._call_all({a: a.draft for a in ks}, item):
            if isinstance(r, Proposal):
                out[a] = r
                a.draft_used = True
            else:
                self._draft_failed(a, r)
        return out

    async def _verify(self, batch: list[_Active], proposals: dict[_Active, Proposal]) -> dict:
        """Each request's ``VerifyResult``, or the exception it fails with; one message per Target replica."""

        def item(ch: Channel, a: _Active) -> VerifyStepItem:
            ctx = self._sent[ch.address.replica].change(a.session_id, a.req.tokens, len(a.req.tokens), a.req.params)
            return VerifyStepItem(ctx, proposals.get(a))

        out = {}
        for a, r in await self._call_all({a: a.target for a in batch}, item):
            if isinstance(r, ChannelClosed):
                r = ReplicaLost(f"Target {a.target.address.replica}: {r}")
            elif isinstance(r, (ItemFailed, Resync)):
                r = RuntimeError(f"verify failed: {r}")
            out[a] = r
        return out

    async def _call_all(self, channels: dict[_Active, Channel],
                        item: Callable[[Channel, _Active], Any]) -> list[tuple[_Active, Any]]:
        """One step message per channel, concurrently: (request, its reply or the call's exception)."""
        groups: dict[Channel, list[_Active]] = collections.defaultdict(list)
        for a, ch in channels.items():
            groups[ch].append(a)
        replies = await asyncio.gather(*(self._call(ch, members, item) for ch, members in groups.items()),
                                       return_exceptions=True)
        return [(a, reply if isinstance(reply, BaseException) else r)
                for members, reply in zip(groups.values(), replies)
                for a, r in zip(members, [reply] * len(members) if isinstance(reply, BaseException) else reply)]

    async def _call(self, ch: Channel, members: list[_Active], item: Callable[[Channel, _Active], Any]) -> list:
        """One step message on ``ch``; items the replica answers ``Resync`` for go again, whole."""
        replies = await ch.call("step", [item(ch, a) for a in members], self._step_timeout_s)
        again = [i for i, r in enumerate(replies) if isinstance(r, Resync)]
        if again:
            for i in again:
                self._sent[ch.address.replica].forget(members[i].session_id)
            retried = await ch.call("step", [item(ch, members[i]) for i in again], self._step_timeout_s)
            for i, r in zip(again, retried):
                replies[i] = r
        return replies

    async def _find_draft(self, a: _Active) -> None:
        """Look up the session's Draft replica and open its channel; on failure the request decodes plain."""
        try:
            a.draft = await self._connect(self._draft, DRAFT_METHODS, a.session_id)
        except Exception as exc:  # noqa: BLE001 - whatever the lookup met, the request decodes plain
            self._draft_failed(a, exc)

    def _find_draft_later(self, a: _Active) -> None:
        """``_find_draft`` in the background (once the draft may be back): plain steps meanwhile."""
        if a.draft_lookup is None or a.draft_lookup.done():
            task = asyncio.get_running_loop().create_task(self._find_draft(a), context=contextvars.Context())
            a.draft_lookup = task

    async def _connect(self, handle: DeploymentHandle, methods: ChannelMethods, session_id: str) -> Channel:
        """The channel to the replica that owns ``session_id`` (opened once per replica)."""
        # In a task of its own with a fresh internal request id (the 2.60 affinity bug, session_router.py).
        call = pinned_gather(lambda: handle.options(session_id=session_id, _by_reference=False).channel.remote())
        (address,) = await asyncio.wait_for(call, self._step_timeout_s)
        ch = self._channels.get(address.replica)
        if ch is None or ch.closed or ch.address != address:
            ch = await Channel.open(address, methods)
            current = self._channels.get(address.replica)
            if current is not None and not current.closed and current.address == address:
                ch.close()  # opened concurrently by another request: share one
                return current
            self._channels[address.replica] = ch
        return ch

    def _draft_failed(self, a: _Active, why) -> None:
        if not a.draft_failed:
            a.draft_failed = True
            self.draft_failures += 1
        a.draft = None
        a.proposal = None
        self._draft_down_until = time.monotonic() + DRAFT_RETRY_S
        logger.warning("request %s: draft failed (%s); plain steps for %.0f s", a.session_id,
                       why.message if isinstance(why, ItemFailed) else why, DRAFT_RETRY_S)

    def _fail(self, a: _Active, exc: BaseException) -> None:
        if a in self._batch:
            self._batch.remove(a)
            self._release(a)
        a.send(exc)

    def _leave(self, a: _Active) -> None:
        self._batch.remove(a)
        self._release(a)

    def _release(self, a: _Active) -> None:
        """Free the session on both sides, in the background (the loop does not wait for it)."""
        if a.draft_lookup is not None:
            a.draft_lookup.cancel()
        sides = [a.target] + ([a.draft] if a.draft is not None and a.draft_used else [])
        for ch in sides:
            self._sent[ch.address.replica].forget(a.session_id)

        async def release() -> None:
            for ch in sides:
                try:
                    await ch.call("release", [a.session_id], self._step_timeout_s)
                except (ChannelClosed, ChannelCallError) as exc:
                    logger.info("release of session %s on %s: %s", a.session_id, ch.address.replica, exc)

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
