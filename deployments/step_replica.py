"""The replica half of the separate topology's step protocol, shared by Draft and Target.

A replica answers one message per step from the loop's owner (the Router): a list of items, one
per session, each carrying the change to that session's context (``deployments/contexts.py``).
It rebuilds each full context, runs the whole list as one batched model call and answers
item by item: a result, ``Resync`` (it does not hold the context: send it whole) or
``ItemFailed``. Messages come over a direct channel (``deployments/channel.py``) whose address a
session-pinned Serve call (``channel``) returns; the replica stays a Serve deployment.

Model work runs on the replica's event loop itself, which serialises access to the model (release
included). A worker thread would keep the loop free during a step, but the loop's owner sends the
next message only after this one's answer, and the two thread handoffs per call cost 0.3-0.4 ms of a
1.9-2.2 ms per-step overhead at batch 1 (``python -m specdec_bench.hops``).
"""

from __future__ import annotations

import logging
from typing import Any

import ray
import torch
from ray import serve

from deployments.channel import ChannelAddress, ChannelMethods, ChannelServer
from deployments.config import AppConfig
from deployments.contexts import ReplicaContexts
from deployments.messages import ItemFailed, Resync, SessionContext
from specdec_core import SamplingParams

logger = logging.getLogger("ray.serve")


def session_generator(params: SamplingParams, stream: int = 0) -> torch.Generator | None:
    """A per-session generator: seeded from (request seed, ``stream``), or randomly; None when greedy.

    The Draft and the Target each draw from a generator of their own (the co-located engine shares
    one), so each needs a stream of its own: seeded alike, the Target's acceptance test would reuse
    the very uniform that drew the draft token it judges, and the output would not follow the target
    distribution (measured: token 3 of overlapped rounds off by 3x the sampling noise)."""
    if params.temperature <= 0:
        return None
    gen = torch.Generator()
    if params.seed is None:
        gen.seed()
    else:
        gen.manual_seed(params.seed if stream == 0 else hash((params.seed, stream)) % 2**63)  # int hash: unsalted
    return gen


class Tombstones:
    """Recently released session ids. Session ids are unique per request, so a step item that
    arrives for a released session is a straggler (its step was given up) and must not
    re-allocate a KV slot."""

    def __init__(self, capacity: int = 65536):
        self._ids: dict[str, None] = {}
        self._capacity = capacity

    def add(self, session_id: str) -> None:
        self._ids[session_id] = None
        if len(self._ids) > self._capacity:
            self._ids.pop(next(iter(self._ids)))

    def __contains__(self, session_id: str) -> bool:
        return session_id in self._ids


class StepReplica:
    """Channel and contexts of a Draft or Target replica. A subclass runs a step's
    items (``_run_step``) and frees a session's model state (``_drop``)."""

    def __init__(self, cfg: AppConfig, methods: ChannelMethods, vocab_size: int):
        self._contexts = ReplicaContexts()
        self._released = Tombstones()
        self._sessions_of: dict[int, set[str]] = {}  # channel peer -> the sessions its steps opened
        self._server = ChannelServer(self._replica_id(), methods, {"step": self._step, "release": self._release},
                                     max_frame_bytes=cfg.channel_frame_bound(vocab_size),
                                     handshake_timeout_s=cfg.channel_handshake_timeout_s, on_close=self._peer_gone)

    async def channel(self) -> ChannelAddress:
        """Where the loop's owner sends this replica's steps (a session-pinned call reaches it): the
        node's address as Ray knows it, where Ray's own ports listen, so a Router on another node
        can reach it."""
        return await self._server.address(ray.util.get_node_ip_address())

    async def _step(self, items: list, peer: int) -> list:
        results: list[Any] = [None] * len(items)
        self._sessions_of.setdefault(peer, set()).update(item.context.session_id for item in items)
        runnable = []  # (index, item, full context, params)
        for i, item in enumerate(items):
            ctx: SessionContext = item.context
            if ctx.session_id in self._released:
                results[i] = ItemFailed(f"session {ctx.session_id} was released")
                continue
            held = self._contexts.apply(ctx)
            if held is None:
                results[i] = Resync()
                continue
            runnable.append((i, item, *held))
        for i, result in zip((r[0] for r in runnable), self._run_step([r[1:] for r in runnable])):
            results[i] = result
        return results

    def _run_step(self, items: list[tuple[Any, list[int], SamplingParams]]) -> list:
        """Results for (item, full context, params) triples, in order."""
        raise NotImplementedError

    def _drop(self, session_id: str) -> bool:
        """Free the session's model state; whether it held any."""
        raise NotImplementedError

    async def _release(self, session_ids: list[str], peer: int) -> int:
        self._sessions_of.get(peer, set()).difference_update(session_ids)
        return self._release_all(session_ids)

    def _peer_gone(self, peer: int) -> None:
        """The loop's owner closed its channel (a Router that died, or restarted): nobody will
        release the sessions its steps opened here, so they are released now."""
        orphans = self._sessions_of.pop(peer, set())
        if orphans:
            logger.warning("channel peer %d closed holding %d session(s): released", peer, len(orphans))
            self._release_all(sorted(orphans))

    def _release_all(self, session_ids: list[str]) -> int:
        held = 0
        for sid in session_ids:
            held += self._drop(sid)
            self._contexts.drop(sid)
            self._released.add(sid)
        return held

    @staticmethod
    def _replica_id() -> str:
        return serve.get_replica_context().replica_id.unique_id
