"""Draft deployment of the separate topology: wraps ``specdec_core.DraftModelProposer``.

One message per step from the loop's owner (``deployments/step_replica.py``): a
``ProposeStepItem`` per session (the change to its context, and K), answered with a ``Proposal``
per session from one batched draft pass. The draft KV cache of a session is soft state that the
proposer reconciles against the context (``SequenceSlots.sync``): a context that ends in a new
step's tokens, or cuts proposed tokens the target rejected, needs no rollback message, and a lost
replica costs a re-prefill. Each session keeps its own ``torch.Generator`` seeded from the
request seed.
"""

from __future__ import annotations

import logging

import torch

from deployments.calibrate import measuring_alone
from deployments.config import AppConfig
from deployments.messages import DRAFT_METHODS, ItemFailed, Placement, ProposeStepItem, SideStats
from deployments.step_replica import StepReplica, session_generator
from specdec_core import DraftModelProposer, ModelRunner, Proposal, ProposalRequest, SamplingParams

DRAFT_STREAM = 1  # the Draft's random stream of a seeded request (the Target's is 0)

logger = logging.getLogger("ray.serve")


class Draft(StepReplica):
    def __init__(self, config: dict):
        cfg = AppConfig(**config)
        torch.set_num_threads(cfg.torch_threads)
        with measuring_alone():  # its kernel probes time this host: one replica at a time
            runner = ModelRunner.from_pretrained(
                cfg.draft, device=cfg.device, dtype=cfg.dtype, max_slots=cfg.max_batch_size,
                max_len=cfg.max_model_len, trust_remote_code=cfg.trust_remote_code, kv_window=cfg.draft_window,
                prefix_cache_tokens=cfg.prefix_cache_tokens,
            )
        self.proposer = DraftModelProposer(runner, name=str(cfg.draft))
        self._generators: dict[str, torch.Generator | None] = {}
        self._max_batch = 0
        self._fail_next = 0
        super().__init__(cfg, DRAFT_METHODS, runner.vocab_size)
        logger.info("Draft ready: %s slots=%d", cfg.draft, runner.num_slots)

    def _run_step(self, items: list[tuple[ProposeStepItem, list[int], SamplingParams]]) -> list:
        self._max_batch = max(self._max_batch, len(items))
        runner = self.proposer.runner
        results: list = [None] * len(items)
        requests, index = [], []
        free = runner.num_free_slots
        for i, (item, hist, smp) in enumerate(items):
            sid, k = item.context.session_id, item.k
            if self._fail_next > 0:
                self._fail_next -= 1
                results[i] = ItemFailed("injected draft failure (fail_next_proposals)")
                continue
            if len(hist) + k > runner.max_len:
                results[i] = ItemFailed(f"draft context full: {len(hist)} tokens + k={k} > {runner.max_len}")
                continue
            if sid not in self.proposer.slots:
                if free == 0:
                    results[i] = ItemFailed("draft: no free KV slot")
                    continue
                free -= 1
            if sid not in self._generators:
                self._generators[sid] = session_generator(smp, DRAFT_STREAM)
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
                    self._drop(req.seq_id)
                    results[i] = ItemFailed(f"draft propose failed: {exc}")
        return results

    def _drop(self, session_id: str) -> bool:
        held = session_id in self.proposer.slots
        self.proposer.release(session_id)
        self._generators.pop(session_id, None)
        return held

    async def fail_next_proposals(self, n: int) -> None:
        """Fault injection for tests and drills: the next ``n`` proposals on this replica fail."""
        self._fail_next = int(n)

    async def stats(self) -> SideStats:
        runner = self.proposer.runner
        return SideStats("Draft", self._replica_id(), self.proposer.num_sequences(),
                         runner.num_free_slots, runner.num_slots, self._max_batch)

    async def where(self, session_id: str) -> Placement:
        """Which replica this pinned call reached and whether it holds the session."""
        return Placement(self._replica_id(), session_id in self.proposer.slots)
