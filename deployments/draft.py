"""Draft deployment of the separate topology: wraps ``specdec_core.DraftModelProposer``.

``propose(session_id, token_ids, k, params)`` drafts K tokens for one session; concurrent calls
from many sessions are fused into one batched draft pass by ``@serve.batch``. The draft KV cache of
a session is soft state: every call carries the authoritative history and the proposer reconciles
against it (``SequenceSlots.sync``), so a rejection needs no rollback message and a lost replica
costs a re-prefill. Each session keeps its own ``torch.Generator`` seeded from the request seed.

Model work runs on one worker thread: it serialises access to the proposer (release included) and
keeps the replica's event loop free to accept and batch the next calls meanwhile.
"""

from __future__ import annotations

import asyncio
import logging
from concurrent.futures import ThreadPoolExecutor

import torch
from ray import serve

from deployments.config import AppConfig
from deployments.messages import Placement, SideStats
from specdec_core import DraftModelProposer, ModelRunner, Proposal, ProposalRequest, SamplingParams

logger = logging.getLogger("ray.serve")


def session_generator(params: SamplingParams) -> torch.Generator | None:
    """A per-session generator: seeded from the request seed, or randomly; None when greedy."""
    if params.temperature <= 0:
        return None
    gen = torch.Generator()
    if params.seed is not None:
        gen.manual_seed(params.seed)
    else:
        gen.seed()
    return gen


class Tombstones:
    """Recently released session ids. Session ids are unique per request, so a call that arrives for
    a released session is a straggler (cancelled in flight) and must not re-allocate a KV slot."""

    def __init__(self, capacity: int = 65536):
        self._ids: dict[str, None] = {}
        self._capacity = capacity

    def add(self, session_id: str) -> None:
        self._ids[session_id] = None
        if len(self._ids) > self._capacity:
            self._ids.pop(next(iter(self._ids)))

    def __contains__(self, session_id: str) -> bool:
        return session_id in self._ids


class _Failed:
    """Per-item failure inside a batch (the other items of the batch still succeed)."""

    def __init__(self, message: str):
        self.message = message


class Draft:
    def __init__(self, config: dict):
        cfg = AppConfig(**config)
        torch.set_num_threads(cfg.torch_threads)
        runner = ModelRunner.from_pretrained(
            cfg.draft, device=cfg.device, dtype=cfg.dtype, max_slots=cfg.max_batch_size,
            max_len=cfg.max_model_len, trust_remote_code=cfg.trust_remote_code,
        )
        self.proposer = DraftModelProposer(runner, name=str(cfg.draft))
        self._generators: dict[str, torch.Generator | None] = {}
        self._worker = ThreadPoolExecutor(1, thread_name_prefix="draft")
        self._released = Tombstones()
        self._max_batch = 0
        self._fail_next = 0
        self._propose_batch.set_max_batch_size(cfg.verify_max_batch_size)
        self._propose_batch.set_batch_wait_timeout_s(cfg.verify_batch_wait_s)
        logger.info("Draft ready: %s slots=%d", cfg.draft, runner.num_slots)

    async def propose(self, session_id: str, token_ids: list[int], k: int, params: SamplingParams) -> Proposal:
        result = await self._propose_batch(session_id, list(token_ids), int(k), params)
        if isinstance(result, _Failed):
            raise RuntimeError(result.message)  # noqa: TRY004 - a per-item failure, not a type error
        return result

    @serve.batch(max_batch_size=32, batch_wait_timeout_s=0.0)
    async def _propose_batch(self, session_ids, histories, ks, samplings) -> list:
        return await asyncio.get_running_loop().run_in_executor(
            self._worker, self._propose_sync, session_ids, histories, ks, samplings
        )

    def _propose_sync(self, session_ids, histories, ks, samplings) -> list:
        self._max_batch = max(self._max_batch, len(session_ids))
        runner = self.proposer.runner
        results: list = [None] * len(session_ids)
        requests, index = [], []
        free = runner.num_free_slots
        for i, (sid, hist, k, smp) in enumerate(zip(session_ids, histories, ks, samplings)):
            if sid in self._released:
                results[i] = _Failed(f"session {sid} was released")
                continue
            if self._fail_next > 0:
                self._fail_next -= 1
                results[i] = _Failed("injected draft failure (fail_next_proposals)")
                continue
            if len(hist) + k > runner.max_len:
                results[i] = _Failed(f"draft context full: {len(hist)} tokens + k={k} > {runner.max_len}")
                continue
            if sid not in self.proposer.slots:
                if free == 0:
                    results[i] = _Failed("draft: no free KV slot")
                    continue
                free -= 1
            if sid not in self._generators:
                self._generators[sid] = session_generator(smp)
            requests.append(ProposalRequest(sid, hist, k, smp.temperature, smp.top_p, smp.top_k,
                                            self._generators[sid]))
            index.append(i)
        if requests:
            try:
                for i, req, prop in zip(index, requests, self.proposer.propose(requests)):
                    # Greedy q is one-hot on the proposed tokens: the verifier rebuilds it from the ids.
                    results[i] = Proposal(prop.token_ids, None if req.temperature <= 0 else prop.probs)
            except Exception as exc:
                logger.exception("draft propose failed for %d session(s)", len(requests))
                for i, req in zip(index, requests):
                    self.proposer.release(req.seq_id)
                    results[i] = _Failed(f"draft propose failed: {exc}")
        return results

    async def release(self, session_id: str) -> bool:
        return await asyncio.get_running_loop().run_in_executor(self._worker, self._release_sync, session_id)

    def _release_sync(self, session_id: str) -> bool:
        held = session_id in self.proposer.slots
        self.proposer.release(session_id)
        self._generators.pop(session_id, None)
        self._released.add(session_id)
        return held

    async def fail_next_proposals(self, n: int) -> None:
        """Fault injection for tests and drills: the next ``n`` propose calls on this replica fail."""
        self._fail_next = int(n)

    async def stats(self) -> SideStats:
        runner = self.proposer.runner
        return SideStats("Draft", serve.get_replica_context().replica_id.unique_id, self.proposer.num_sequences(),
                         runner.num_free_slots, runner.num_slots, self._max_batch)

    async def where(self, session_id: str) -> Placement:
        """Which replica this pinned call reached and whether it holds the session."""
        return Placement(serve.get_replica_context().replica_id.unique_id, session_id in self.proposer.slots)
