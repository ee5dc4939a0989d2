"""Target deployment of the separate topology: wraps ``specdec_core.Verifier``.

``verify(session_id, token_ids, proposal, params)`` runs one verify step (Leviathan et al. 2023,
Algorithm 1) for one session; ``@serve.batch`` fuses the concurrent calls of many sessions into one
target forward (``Verifier.verify`` takes a list). ``proposal`` is the Draft's proposal, which the
router received and sends on, or None for a
plain step (prefill, K=0, or a request whose draft failed). The outcome (emitted tokens, accepted
count: a ``VerifyResult``) goes back to the router, which owns the history and sends it with the next call; the
verifier reconciles its KV cache against it (``SequenceSlots.sync``).
"""

from __future__ import annotations

import asyncio
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import torch
from ray import serve

from deployments.config import AppConfig
from deployments.draft import Tombstones, _Failed, session_generator
from deployments.messages import Placement, SideStats
from specdec_core import ModelRunner, Proposal, SamplingParams, Verifier, VerifyItem, VerifyResult

logger = logging.getLogger("ray.serve")


@dataclass
class _Session:
    generator: torch.Generator | None
    opened: float
    steps: int = 0
    proposed: int = 0
    accepted: int = 0
    emitted: int = 0


class Target:
    def __init__(self, config: dict):
        cfg = AppConfig(**config)
        torch.set_num_threads(cfg.torch_threads)
        runner = ModelRunner.from_pretrained(
            cfg.target, device=cfg.device, dtype=cfg.dtype, max_slots=cfg.max_batch_size,
            max_len=cfg.max_model_len, trust_remote_code=cfg.trust_remote_code,
        )
        self.verifier = Verifier(runner)
        self._sessions: dict[str, _Session] = {}
        self._worker = ThreadPoolExecutor(1, thread_name_prefix="target")
        self._released = Tombstones()
        self._max_batch = 0
        self._batches = 0
        self._opened = 0
        self._verify_batch.set_max_batch_size(cfg.verify_max_batch_size)
        self._verify_batch.set_batch_wait_timeout_s(cfg.verify_batch_wait_s)
        logger.info("Target ready: %s slots=%d", cfg.target, runner.num_slots)

    async def verify(self, session_id: str, token_ids: list[int], proposal: Proposal | None,
                     params: SamplingParams) -> VerifyResult:
        result = await self._verify_batch(session_id, list(token_ids), proposal or Proposal([], None), params)
        if isinstance(result, _Failed):
            raise RuntimeError(result.message)  # noqa: TRY004 - a per-item failure, not a type error
        return result

    @serve.batch(max_batch_size=32, batch_wait_timeout_s=0.0)
    async def _verify_batch(self, session_ids, histories, proposals, samplings) -> list:
        return await asyncio.get_running_loop().run_in_executor(
            self._worker, self._verify_sync, session_ids, histories, proposals, samplings
        )

    def _verify_sync(self, session_ids, histories, proposals, samplings) -> list:
        self._batches += 1
        self._max_batch = max(self._max_batch, len(session_ids))
        runner = self.verifier.runner
        results: list = [None] * len(session_ids)
        items, index = [], []
        free = runner.num_free_slots
        for i, (sid, hist, prop, smp) in enumerate(zip(session_ids, histories, proposals, samplings)):
            if sid in self._released:
                results[i] = _Failed(f"session {sid} was released")
                continue
            if sid in (items[j].seq_id for j in range(len(items))):
                results[i] = _Failed(f"session {sid} verified twice in one batch")
                continue
            if len(hist) + len(prop.token_ids) > runner.max_len:
                results[i] = _Failed(f"context full: {len(hist)} + {len(prop.token_ids)} > {runner.max_len}")
                continue
            if sid not in self.verifier.slots:
                if free == 0:
                    results[i] = _Failed("target: no free KV slot")
                    continue
                free -= 1
            sess = self._sessions.get(sid)
            if sess is None:
                sess = self._sessions[sid] = _Session(session_generator(smp), time.perf_counter())
                self._opened += 1
            items.append(VerifyItem(sid, hist, prop, smp.temperature, smp.top_p, smp.top_k, sess.generator))
            index.append(i)
        for i, item, res in zip(index, items, self._verify_isolated(items)):
            if isinstance(res, _Failed):
                results[i] = res
                continue
            sess = self._sessions[item.seq_id]
            sess.steps += 1
            sess.proposed += res.num_proposed
            sess.accepted += res.num_accepted
            sess.emitted += len(res.emitted)
            results[i] = res
        return results

    def _verify_isolated(self, items: list[VerifyItem]) -> list:
        """One batched verify; if it fails, each item again on its own, so that only the sessions
        that fail alone get a ``_Failed`` (the verifier's cache reconciles on the retry)."""
        if not items:
            return []
        try:
            return self.verifier.verify(items)
        except Exception:
            logger.exception("verify of %d sessions failed; retrying them one at a time", len(items))
        results = []
        for item in items:
            try:
                results += self.verifier.verify([item])
            except Exception:
                logger.exception("session %s fails verify on its own", item.seq_id)
                results.append(_Failed(f"session {item.seq_id}: verify failed"))
        return results

    async def release(self, session_id: str) -> bool:
        return await asyncio.get_running_loop().run_in_executor(self._worker, self._release_sync, session_id)

    def _release_sync(self, session_id: str) -> bool:
        held = session_id in self.verifier.slots
        self.verifier.release(session_id)
        sess = self._sessions.pop(session_id, None)
        self._released.add(session_id)
        if sess is not None:
            logger.info(
                "session %s topology=separate steps=%d proposed=%d accepted=%d acceptance=%.3f emitted=%d "
                "held=%.3fs", session_id, sess.steps, sess.proposed, sess.accepted,
                sess.accepted / sess.proposed if sess.proposed else 0.0, sess.emitted,
                time.perf_counter() - sess.opened,
            )
        return held

    async def stats(self) -> SideStats:
        runner = self.verifier.runner
        return SideStats("Target", serve.get_replica_context().replica_id.unique_id, len(self.verifier.slots),
                         runner.num_free_slots, runner.num_slots, self._max_batch, self._opened, self._batches)

    async def where(self, session_id: str) -> Placement:
        """Which replica this pinned call reached and whether it holds the session."""
        return Placement(serve.get_replica_context().replica_id.unique_id, session_id in self.verifier.slots)
