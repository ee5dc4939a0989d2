"""Operator views of the deployments behind the router (tests and ``GET /v1/stats``): the
``stats()`` of every replica (typed messages, ``deployments/messages.py``; JSON-ready dicts out of
here, with ``sessions`` added for engine replicas), and where pinned sessions land."""

from __future__ import annotations

import asyncio
import dataclasses

from ray.serve.handle import DeploymentHandle

from deployments.session_router import pinned_gather


async def engine_pool_stats(handle: DeploymentHandle, n_replicas: int) -> list[dict]:
    """stats() of every replica of an engine pool. Engine pools use Serve's default routing:
    sample until every replica has answered once (exact for one replica; with n replicas, 4n calls
    miss one with probability ~n e^-4)."""
    seen: dict[str, dict] = {}
    for _ in range(1 if n_replicas <= 1 else 4 * n_replicas):
        st = await handle.stats.remote()
        seen.setdefault(st.replica, {**dataclasses.asdict(st), "sessions": st.sessions})
        if len(seen) >= n_replicas:
            break
    return list(seen.values())


async def pinned_stats(handle: DeploymentHandle, n_replicas: int) -> list[dict]:
    """stats() of every replica of a session-pinned deployment (Draft, Target): one pinned call per
    replica, found by probing session ids (affinity decides placement)."""
    probes = [f"__stats-probe-{i}" for i in range(max(8, 8 * n_replicas))]
    placed = await pinned_gather(*(lambda s=s: handle.options(session_id=s).where.remote(s) for s in probes))
    one_per_replica = {p.replica: s for s, p in zip(probes, placed)}
    stats = await pinned_gather(*(lambda s=s: handle.options(session_id=s).stats.remote()
                                  for s in one_per_replica.values()))
    return [dataclasses.asdict(st) for st in stats]


async def probe_sessions(handle: DeploymentHandle, session_ids: list[str], fresh_ids: bool = True,
                         timeout_s: float = 30.0) -> dict:
    """Concurrent pinned ``where`` calls from inside one request (the 2.60 gather bug's shape).
    -> {"placement": [{"replica", "holds"}...]} or {"timed_out": True}."""
    calls = [lambda s=s: handle.options(session_id=s).where.remote(s) for s in session_ids]
    try:
        placement = await asyncio.wait_for(pinned_gather(*calls, fresh_ids=fresh_ids), timeout_s)
    except asyncio.TimeoutError:
        return {"timed_out": True}
    return {"placement": [dataclasses.asdict(p) for p in placement]}
