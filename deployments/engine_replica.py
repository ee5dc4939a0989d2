"""EngineReplica: one engine per replica, continuous batching (in a process of its own by default,
``deployments/engine_process.py``; ``deployments/engine_hosts.py`` for both placements).

Configured with a draft it is the co-located speculative pool (draft and target share the process
and every step's batch); without one it is the plain pool. The same class is deployed twice under
different names (see app.py). The engine owns each request's history; this class only translates
between the router's messages (``deployments/messages.py``) and the engine, and reports load.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import AsyncIterator

from ray import serve

from deployments.config import AppConfig
from deployments.engine_hosts import EngineThread
from deployments.engine_process import EngineProcess
from deployments.messages import Delta, EngineStats, GenerateRequest, ReplicaCosts
from deployments.metrics import log_request
from specdec_core.async_engine import coalesced

logger = logging.getLogger("ray.serve")


def _exit_replica() -> None:
    """The engine process died: so does the replica, and Serve replaces it. Its requests then fail as
    after any replica death, which the router migrates (a replica answering with a dead engine would
    fail them where nothing migrates them)."""
    logger.error("engine process died; exiting the replica")
    os._exit(1)


class EngineReplica:
    def __init__(self, config: dict, speculative: bool, pool: str):
        cfg = AppConfig(**config)
        self.pool = pool
        self.engine = (EngineProcess(cfg, speculative, pool, on_death=_exit_replica) if cfg.engine_process
                       else EngineThread(cfg, speculative, pool))
        self._served = 0
        self._aborted = 0
        self._streams = 0

    async def costs(self) -> ReplicaCosts | None:
        """The replica's step costs (greedy, and sampled when calibrated) and their source; None without."""
        return self.engine.costs

    def record_autoscaling_stats(self) -> dict:
        """Serve calls this on each replica; `active_sequences` is the autoscaling policy's `metric`."""
        return {"active_sequences": float(sum(self.engine.load()))}

    async def generate(self, req: GenerateRequest) -> AsyncIterator[Delta]:
        """Stream one request (call with ``handle.options(stream=True)``). With ``adaptive_k``
        (mode=auto) the engine re-chooses K <= num_speculative_tokens every step. Steps are
        coalesced into one delta per ``stream_interval_s`` (the first and the last go out at once);
        without it the whole output is one delta. Leaving early (caller cancels, client gone)
        aborts the request inside the engine and frees its slots."""
        t0 = time.perf_counter()
        last = None
        self._streams += 1
        stream = self.engine.stream(req)
        try:
            async for delta in coalesced(stream, req.stream_interval_s):
                last = delta
                yield delta
        finally:
            self._streams -= 1
            try:
                await stream.aclose()  # early exit: aborts the request in the engine, frees its slots
            finally:
                self._log(req, last, time.perf_counter() - t0)

    def _log(self, req: GenerateRequest, last: Delta | None, latency_s: float) -> None:
        self._served += 1
        finished = last is not None and last.finished
        if not finished:
            self._aborted += 1
        log_request(logger, req.request_id, self.pool, req.params.num_speculative_tokens, "colocated",
                    len(req.prompt_ids), last.stats if last is not None else None, latency_s,
                    last.finish_reason if finished else "abort")

    async def stats(self) -> EngineStats:
        """Load and state: what the router and the tests read."""
        costs = self.engine.costs
        return EngineStats(pool=self.pool, replica=serve.get_replica_context().replica_id.unique_id,
                           streams=self._streams, served=self._served, aborted=self._aborted,
                           costs_source=costs.source if costs else None, **await self.engine.fields())

    def check_health(self) -> None:
        if not self.engine.alive():
            raise RuntimeError("the engine is gone")

    def __del__(self):
        try:
            self.engine.shutdown()
        except Exception:
            logger.debug("engine shutdown failed", exc_info=True)
