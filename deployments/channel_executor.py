"""The separate topology's executor: a ``StepPlan`` (``specdec_core.scheduler``) run over direct
channels to the Draft and Target deployments, one message per replica per phase.

A step proposes on the Draft for the rows that need a fresh proposal, then verifies every row on
the Target (Leviathan et al. 2023, Algorithm 1; q is the draft's distribution, p the target's; a
verify emits the accepted draft tokens and one recovered or bonus token). Sessions are found by a
session-pinned Serve call (``SessionAffinityRouter``), then reached over ``deployments/channel.py``;
messages carry the change of each session's context, not its history (``deployments/contexts.py``).
The replicas hold soft KV state that they reconcile against the context they rebuild.

Overlap (PEARL's post-verify, Liu et al. 2024), this executor's capability: while the Target verifies
a proposal P, the Draft proposes the next round O after the optimistic context history + P, for the
rows ``overlap`` says it pays for (``RouteState.overlaps``). The scheduler keeps O when the target
accepts all of P (``StepResult.ahead``).

Faults: a draft that fails or does not answer within ``step_timeout_s`` (a dead Draft closes its
channel: at once) turns its rows' steps plain (``StepResult.draft_failed``), and no row looks for a
draft for ``DRAFT_RETRY_S``. A Target that is gone or does not answer in time fails its rows with
``ReplicaLost``: they migrate (``deployments/pools.py``).
"""

from __future__ import annotations

import asyncio
import collections
import contextvars
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ray.serve.handle import DeploymentHandle

from deployments.channel import Channel, ChannelCallError, ChannelClosed, ChannelMethods
from deployments.contexts import SentContexts
from deployments.messages import DRAFT_METHODS, TARGET_METHODS, ItemFailed, ProposeStepItem, Resync, VerifyStepItem
from deployments.session_router import pinned_gather
from specdec_core import Proposal
from specdec_core.scheduler import NO_PROPOSAL, ScheduledRequest, StepPlan, StepResult
from specdec_core.stats import StepTiming

logger = logging.getLogger("ray.serve")

DRAFT_RETRY_S = 5.0  # after a draft failure, requests decode plain this long before trying it again
# (batch, K of its round, the request) -> does the Draft propose the round after it during its verify?
OverlapPolicy = Callable[[int, int, ScheduledRequest], bool]


class ReplicaLost(Exception):
    """A replica did not answer in time: presumed dead or restarting."""


@dataclass(eq=False)
class _Session:
    """One request's sessions on the Target and the Draft."""

    session_id: str
    target: Channel
    draft: Channel | None = None  # None until found, and after a draft failure
    draft_lookup: asyncio.Task | None = None
    draft_used: bool = False


@dataclass
class OverlapStats:
    proposed: int = 0  # overlapped proposals made
    kept: int = 0  # ... that became the next round's proposal (the target accepted all it verified)


@dataclass
class _Step:
    """One step's sessions, by row."""

    plan: StepPlan
    sessions: dict[ScheduledRequest, _Session] = field(default_factory=dict)


class ChannelExecutor:
    def __init__(self, draft: DeploymentHandle, target: DeploymentHandle, max_model_len: int,
                 step_timeout_s: float, overlap: OverlapPolicy):
        self._draft, self._target = draft, target
        self._max_model_len = max_model_len
        self._step_timeout_s = step_timeout_s
        self._overlap = overlap
        self._sessions: dict[str, _Session] = {}  # request id -> its sessions
        self._channels: dict[str, Channel] = {}  # replica id -> open channel
        self._sent: dict[str, SentContexts] = collections.defaultdict(SentContexts)  # replica id -> ...
        self._draft_down_until = 0.0
        self.overlap = OverlapStats()
        self.background: set[asyncio.Task] = set()

    # ---- sessions ------------------------------------------------------------------------------

    async def attach(self, request_id: str, session_id: str, wants_draft: bool) -> bool:
        """Open the request's Target session (raises ReplicaLost) and look its Draft up meanwhile;
        False if that lookup failed (the request decodes plain)."""
        draft_up = wants_draft and time.monotonic() >= self._draft_down_until
        draft_lookup = asyncio.ensure_future(self._connect(self._draft, DRAFT_METHODS, session_id)) if draft_up \
            else None
        try:
            target = await self._connect(self._target, TARGET_METHODS, session_id)
        except Exception as exc:
            if draft_lookup is not None:
                draft_lookup.cancel()
            raise ReplicaLost(f"no Target channel: {exc}") from exc
        s = self._sessions[request_id] = _Session(session_id, target)
        if draft_lookup is not None:
            try:
                s.draft = await draft_lookup
            except Exception as exc:  # noqa: BLE001 - whatever the lookup met, the request decodes plain
                self._draft_down(session_id, exc)
                return False
        return True

    def release(self, request_id: str) -> None:
        """Free the request's sessions on both sides, in the background (the loop does not wait)."""
        s = self._sessions.pop(request_id, None)
        if s is None:
            return
        if s.draft_lookup is not None:
            s.draft_lookup.cancel()
        sides = [s.target] + ([s.draft] if s.draft is not None and s.draft_used else [])
        for ch in sides:
            self._sent[ch.address.replica].forget(s.session_id)

        async def release() -> None:
            for ch in sides:
                try:
                    await ch.call("release", [s.session_id], self._step_timeout_s)
                except (ChannelClosed, ChannelCallError) as exc:
                    logger.info("release of session %s on %s: %s", s.session_id, ch.address.replica, exc)

        task = asyncio.get_running_loop().create_task(release(), context=contextvars.Context())
        self.background.add(task)
        task.add_done_callback(self.background.discard)

    async def ping(self) -> None:
        """Does the Target answer (a health probe after it was lost)?"""
        await self._target.options(session_id="__health-probe").where.remote("__health-probe")

    # ---- the step ------------------------------------------------------------------------------

    async def execute(self, plan: StepPlan) -> StepResult:
        step = _Step(plan, {r: self._sessions[r.request_id] for r in plan.rows})
        timing = StepTiming()
        t = time.perf_counter()
        proposals = [r.carried or NO_PROPOSAL for r in plan.decode]
        wanted = [(i, k) for i, (r, k) in enumerate(zip(plan.decode, plan.ks))
                  if k > 0 and r.carried is None and self._has_draft(step.sessions[r])]
        fresh, failed = await self._propose(step, wanted, proposals)
        for i, prop in fresh.items():
            proposals[i] = prop
        timing.propose_s = time.perf_counter() - t
        t = time.perf_counter()
        batch = len(plan.decode)
        ahead = [(i, r.budget_k(k, self._max_model_len, len(proposals[i].token_ids)))
                 for i, (r, k) in enumerate(zip(plan.decode, plan.ks))
                 if proposals[i].token_ids and self._overlap(batch, k, r)]
        verified, (optimistic, failed_ahead) = await asyncio.gather(
            self._verify(step, proposals), self._propose(step, [x for x in ahead if x[1] > 0], proposals, after=True))
        timing.verify_s = time.perf_counter() - t
        self.overlap.proposed += len(optimistic)
        self.overlap.kept += sum(1 for i, p in optimistic.items()
                                 if not isinstance(verified[len(plan.prefill) + i], BaseException)
                                 and verified[len(plan.prefill) + i].num_accepted == len(proposals[i].token_ids))
        timing.total_s = timing.propose_s + timing.verify_s
        return StepResult(proposals, verified, failed | failed_ahead, optimistic, timing)

    def _has_draft(self, s: _Session) -> bool:
        """Can this row get a fresh proposal now? A row without a draft looks for one in the background."""
        if time.monotonic() < self._draft_down_until:
            return False
        if s.draft is None or s.draft.closed:
            s.draft = None
            self._find_draft_later(s)
            return False
        return True

    async def _propose(self, step: _Step, wanted: list[tuple[int, int]], proposals: list[Proposal],
                       after: bool = False) -> tuple[dict[int, Proposal], set[int]]:
        """Proposals of K tokens for each (decode row, K) after its history (and, ``after``, after its
        proposal: the overlapped round), one message per Draft replica; and the rows whose draft failed."""
        rows = step.plan.decode
        ks = {rows[i]: (i, k) for i, k in wanted
              if step.sessions[rows[i]].draft is not None and not step.sessions[rows[i]].draft.closed}
        if not ks or time.monotonic() < self._draft_down_until:
            return {}, set()

        def item(ch: Channel, r: ScheduledRequest) -> ProposeStepItem:
            i, k = ks[r]
            context = r.tokens + (proposals[i].token_ids if after else [])
            ctx = self._sent[ch.address.replica].change(step.sessions[r].session_id, context, len(r.tokens), r.params)
            return ProposeStepItem(ctx, k)

        out, failed = {}, set()
        for r, reply in await self._call_all(step, {r: step.sessions[r].draft for r in ks}, item):
            s = step.sessions[r]
            if isinstance(reply, Proposal):
                out[ks[r][0]] = reply
                s.draft_used = True
            else:
                failed.add(ks[r][0])
                s.draft = None
                self._draft_down(s.session_id, reply)
        return out, failed

    async def _verify(self, step: _Step, proposals: list[Proposal]) -> list:
        """Each row's ``VerifyResult``, or the exception it fails with; one message per Target replica."""
        rows = step.plan.rows
        proposal_of = dict(zip(step.plan.decode, proposals))

        def item(ch: Channel, r: ScheduledRequest) -> VerifyStepItem:
            ctx = self._sent[ch.address.replica].change(step.sessions[r].session_id, r.tokens, len(r.tokens), r.params)
            return VerifyStepItem(ctx, proposal_of.get(r))

        out = dict(await self._call_all(step, {r: step.sessions[r].target for r in rows}, item))
        for r, reply in out.items():
            if isinstance(reply, ChannelClosed):
                out[r] = ReplicaLost(f"Target {step.sessions[r].target.address.replica}: {reply}")
            elif isinstance(reply, (ItemFailed, Resync)):
                out[r] = RuntimeError(f"verify failed: {reply}")
        return [out[r] for r in rows]

    async def _call_all(self, step: _Step, channels: dict[ScheduledRequest, Channel],
                        item: Callable[[Channel, ScheduledRequest], Any]) -> list[tuple[ScheduledRequest, Any]]:
        """One step message per channel, concurrently: (row, its reply or the call's exception)."""
        groups: dict[Channel, list[ScheduledRequest]] = collections.defaultdict(list)
        for r, ch in channels.items():
            groups[ch].append(r)
        replies = await asyncio.gather(*(self._call(step, ch, members, item) for ch, members in groups.items()),
                                       return_exceptions=True)
        return [(r, reply if isinstance(reply, BaseException) else x)
                for members, reply in zip(groups.values(), replies)
                for r, x in zip(members, [reply] * len(members) if isinstance(reply, BaseException) else reply)]

    async def _call(self, step: _Step, ch: Channel, members: list[ScheduledRequest],
                    item: Callable[[Channel, ScheduledRequest], Any]) -> list:
        """One step message on ``ch``; items the replica answers ``Resync`` for go again, whole."""
        replies = await ch.call("step", [item(ch, r) for r in members], self._step_timeout_s)
        again = [j for j, x in enumerate(replies) if isinstance(x, Resync)]
        if again:
            for j in again:
                self._sent[ch.address.replica].forget(step.sessions[members[j]].session_id)
            retried = await ch.call("step", [item(ch, members[j]) for j in again], self._step_timeout_s)
            for j, x in zip(again, retried):
                replies[j] = x
        return replies

    # ---- drafts and channels -------------------------------------------------------------------

    def _find_draft_later(self, s: _Session) -> None:
        """Look the session's Draft up in the background (once the draft may be back): plain steps meanwhile."""
        if s.draft_lookup is not None and not s.draft_lookup.done():
            return

        async def find() -> None:
            try:
                s.draft = await self._connect(self._draft, DRAFT_METHODS, s.session_id)
            except Exception as exc:  # noqa: BLE001 - whatever the lookup met, the request decodes plain
                self._draft_down(s.session_id, exc)

        s.draft_lookup = asyncio.get_running_loop().create_task(find(), context=contextvars.Context())

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

    def _draft_down(self, session_id: str, why) -> None:
        self._draft_down_until = time.monotonic() + DRAFT_RETRY_S
        logger.warning("request %s: draft failed (%s); plain steps for %.0f s", session_id,
                       why.message if isinstance(why, ItemFailed) else why, DRAFT_RETRY_S)
