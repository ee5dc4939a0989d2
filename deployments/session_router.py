"""Session affinity for the separate topology's Draft and Target deployments.

A request's steps must reach the replica of Draft (and of Target) that holds its KV cache: the
separate loop looks the replica up with a pinned call (``channel``, then its steps go over that
replica's channel; ``where`` and ``stats`` for operators). The caller pins a call with
``handle.options(session_id=...)``; ``SessionAffinityRouter`` maps the session id to a replica by
rendezvous (highest-random-weight) hashing over the current replica set: deterministic across
processes (so several router replicas agree), and when a replica leaves only its own sessions move
(they re-prefill elsewhere: KV caches are soft state, and a replica that lacks a context asks for
it whole). Calls without a session id go to the less loaded of the candidates.

Ray Serve 2.60 bug (docs/ARCHITECTURE.md, Facts): a non-FIFO request router indexes pending requests by the
*parent* request's internal id, so two pinned calls issued concurrently from inside one request
(``asyncio.gather``) share that id; the second is never indexed and its routing never completes.
``pinned_gather`` gives each call a fresh internal request id in the serve request context before
issuing it. That touches private API (``ray.serve.context._serve_request_context``);
tests/cluster/serve_app/test_app_affinity.py::test_session_affinity_gather_regression covers it.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
from collections.abc import Awaitable, Callable
from typing import TypeVar

from ray.serve.request_router import PendingRequest, RequestRouter, RunningReplica

T = TypeVar("T")


def _weight(session_id: str, replica_unique_id: str) -> int:
    # blake2b, not hash(): Python's str hash is salted per process.
    digest = hashlib.blake2b(f"{session_id}\x00{replica_unique_id}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big")


def owner(session_id: str, replica_unique_ids: list[str]) -> str:
    """The replica that owns a session: highest rendezvous weight."""
    return max(replica_unique_ids, key=lambda rid: _weight(session_id, rid))


class SessionAffinityRouter(RequestRouter):
    """Strict affinity on ``RequestMetadata.session_id``; least-loaded-of-all without one.

    A pinned call waits (with the router's backoff) for its owner rather than spilling to another
    replica: spilling would only trade waiting for a re-prefill of the whole history.
    """

    async def choose_replicas(
        self,
        candidate_replicas: list[RunningReplica],
        pending_request: PendingRequest | None = None,
    ) -> list[list[RunningReplica]]:
        if not candidate_replicas:
            return []
        session_id = pending_request.metadata.session_id if pending_request is not None else ""
        if not session_id:
            return [list(candidate_replicas)]
        pending_request.routing_context.should_backoff = True
        chosen = max(candidate_replicas, key=lambda r: _weight(session_id, r.replica_id.unique_id))
        return [[chosen]]


def fresh_internal_request_id() -> None:
    """Give the current task's serve request context a new internal request id (private API;
    workaround for the 2.60 bug above). Call it inside a task, before ``.remote()``."""
    from ray.serve import context as serve_context
    from ray.serve._private.utils import generate_request_id

    ctx = serve_context._get_serve_request_context()
    serve_context._serve_request_context.set(dataclasses.replace(ctx, _internal_request_id=generate_request_id()))


async def pinned_gather(*calls: Callable[[], Awaitable[T]], fresh_ids: bool = True) -> list[T]:
    """``asyncio.gather`` over handle calls, each issued in its own task with its own internal request
    id. Pass thunks (``lambda: h.options(session_id=s).m.remote()``): the request metadata is taken
    when ``.remote()`` runs, so it must run inside the task. ``fresh_ids=False`` reproduces the bug."""

    async def run(call: Callable[[], Awaitable[T]]) -> T:
        if fresh_ids:
            fresh_internal_request_id()
        return await call()

    return list(await asyncio.gather(*(run(c) for c in calls)))
