"""Target deployment of the separate topology: wraps ``specdec_core.Verifier``.

One message per step from the loop's owner (``deployments/step_replica.py``): a
``VerifyStepItem`` per session (the change to its context, and the Draft's proposal or None for a
plain step: the prefill, K=0, or a request whose draft failed), run as one batched target forward
(Leviathan et al. 2023, Algorithm 1: the accepted draft tokens, then one recovered or bonus token).
The outcome (a ``VerifyResult``) goes back to the loop's owner, which owns the history; the
verifier reconciles its KV cache against the context it rebuilds (``SequenceSlots.sync``).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import torch

from deployments.calibrate import measuring_alone
from deployments.config import AppConfig
from deployments.messages import TARGET_METHODS, ItemFailed, Placement, SideStats, VerifyStepItem
from deployments.step_replica import StepReplica, session_generator
from specdec_core import ModelRunner, Proposal, SamplingParams, Verifier, VerifyItem

logger = logging.getLogger("ray.serve")
NO_PROPOSAL = Proposal([], None)


@dataclass
class _Session:
    generator: torch.Generator | None
    opened: float
    steps: int = 0
    proposed: int = 0
    accepted: int = 0
    emitted: int = 0


class Target(StepReplica):
    def __init__(self, config: dict):
        cfg = AppConfig(**config)
        torch.set_num_threads(cfg.torch_threads)
        with measuring_alone():  # its kernel probes time this host: one replica at a time
            runner = ModelRunner.from_pretrained(
                cfg.target, device=cfg.device, dtype=cfg.dtype, max_slots=cfg.max_batch_size,
                max_len=cfg.max_model_len, trust_remote_code=cfg.trust_remote_code,
                prefix_cache_tokens=cfg.prefix_cache_tokens,
            )
        self.verifier = Verifier(runner)
        self._sessions: dict[str, _Session] = {}
        self._max_batch = 0
        self._batches = 0
        self._opened = 0
        super().__init__(cfg, TARGET_METHODS, runner.vocab_size)
        logger.info("Target ready: %s slots=%d", cfg.target, runner.num_slots)

    def _run_step(self, items: list[tuple[VerifyStepItem, list[int], SamplingParams]]) -> list:
        self._batches += 1
        self._max_batch = max(self._max_batch, len(items))
        runner = self.verifier.runner
        results: list = [None] * len(items)
        verify, index = [], []
        free = runner.num_free_slots
        for i, (item, hist, smp) in enumerate(items):
            sid, prop = item.context.session_id, item.proposal or NO_PROPOSAL
            if any(v.seq_id == sid for v in verify):
                results[i] = ItemFailed(f"session {sid} verified twice in one step")
                continue
            if len(hist) + len(prop.token_ids) > runner.max_len:
                results[i] = ItemFailed(f"context full: {len(hist)} + {len(prop.token_ids)} > {runner.max_len}")
                continue
            if sid not in self.verifier.slots:
                if free == 0:
                    results[i] = ItemFailed("target: no free KV slot")
                    continue
                free -= 1
            sess = self._sessions.get(sid)
            if sess is None:
                sess = self._sessions[sid] = _Session(session_generator(smp), time.perf_counter())
                self._opened += 1
            verify.append(VerifyItem(sid, hist, prop, smp.temperature, smp.top_p, smp.top_k, sess.generator))
            index.append(i)
        for i, item, res in zip(index, verify, self._verify_isolated(verify)):
            if not isinstance(res, ItemFailed):
                sess = self._sessions[item.seq_id]
                sess.steps += 1
                sess.proposed += res.num_proposed
                sess.accepted += res.num_accepted
                sess.emitted += len(res.emitted)
            results[i] = res
        return results

    def _verify_isolated(self, items: list[VerifyItem]) -> list:
        """One batched verify; if it fails, each item again on its own, so that only the sessions
        that fail alone get an ``ItemFailed`` (the verifier's cache reconciles on the retry)."""
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
                results.append(ItemFailed(f"session {item.seq_id}: verify failed"))
        return results

    def _drop(self, session_id: str) -> bool:
        held = session_id in self.verifier.slots
        self.verifier.release(session_id)
        sess = self._sessions.pop(session_id, None)
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
        return SideStats("Target", self._replica_id(), len(self.verifier.slots),
                         runner.num_free_slots, runner.num_slots, self._max_batch, self._opened, self._batches)

    async def where(self, session_id: str) -> Placement:
        """Which replica this pinned call reached and whether it holds the session."""
        return Placement(self._replica_id(), session_id in self.verifier.slots)
