"""Target-side verification: one batched target pass over every sequence's draft tokens.

Leviathan et al. 2023, Algorithm 1, lines 5-end: the target computes p at the K draft positions
and at the bonus position in parallel; ``rejection_sample`` keeps the accepted prefix and adds one
recovered or bonus token. A sequence with no draft tokens (K=0) is a plain decoding step through
the same code path, and a sequence whose cache is empty is a prefill, so plain, speculative and new
requests can share the target's batch.

After the pass the target cache is truncated to the accepted prefix: rejected draft positions are
dropped, and the recovered/bonus token is fed at the start of the next pass.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

import torch

from specdec_core.proposers.base import Proposal
from specdec_core.runner import ModelRunner
from specdec_core.sampling import (
    greedy_verify,
    process_logits_per_row,
    rejection_sample_unchecked,
    sample_categorical,
)
from specdec_core.slots import SequenceSlots


@dataclass
class VerifyItem:
    seq_id: str
    token_ids: list[int]  # authoritative history
    proposal: Proposal
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    generator: torch.Generator | None = None


@dataclass
class VerifyResult:
    emitted: list[int]  # accepted draft tokens + one recovered or bonus token
    num_proposed: int
    num_accepted: int


class Verifier:
    def __init__(self, runner: ModelRunner):
        self.runner = runner
        self.slots = SequenceSlots(runner)

    def release(self, seq_id: str) -> None:
        self.slots.release(seq_id)

    def verify(self, items: list[VerifyItem]) -> list[VerifyResult]:
        if not items:
            return []
        for it in items:
            if len(it.token_ids) + len(it.proposal.token_ids) > self.runner.max_len:
                raise ValueError(
                    f"context full: {len(it.token_ids)} tokens + {len(it.proposal.token_ids)} draft tokens "
                    f"> max_len {self.runner.max_len}"
                )
        pending = [self.slots.sync(it.seq_id, it.token_ids) for it in items]
        feeds = [p + it.proposal.token_ids for p, it in zip(pending, items)]
        ks = [len(it.proposal.token_ids) for it in items]
        logits = self.runner.forward(
            [self.slots.slot(it.seq_id) for it in items], feeds, [k + 1 for k in ks]
        )  # [B, max K + 1, V]
        emitted = self._sample(items, ks, logits)
        results = []
        for it, k, feed, out in zip(items, ks, feeds, emitted):
            self.slots.fed(it.seq_id, feed)
            num_accepted = len(out) - 1
            self.slots.keep(it.seq_id, len(it.token_ids) + num_accepted)
            results.append(VerifyResult(out, k, num_accepted))
        return results

    def _sample(self, items: list[VerifyItem], ks: list[int], logits: torch.Tensor) -> list[list[int]]:
        """Emitted tokens per row from the target logits [B, max K + 1, V]. Greedy rows are batched
        per K; sampled rows use their own generator, so a request's random stream does not depend
        on what else shares the batch."""
        out: list[list[int]] = [[] for _ in items]
        greedy_groups: dict[int, list[int]] = defaultdict(list)
        sampled = []
        for i, it in enumerate(items):
            (greedy_groups[ks[i]] if it.temperature == 0 else sampled).append(i)
        for k, rows in greedy_groups.items():
            ids = torch.tensor([items[i].proposal.token_ids for i in rows], dtype=torch.long).view(len(rows), k)
            for i, toks in zip(rows, greedy_verify(ids, logits[rows, : k + 1])):
                out[i] = toks
        if sampled:
            target_probs = process_logits_per_row(logits[sampled], [items[i] for i in sampled])  # [S, K+1, V]
            for j, i in enumerate(sampled):
                out[i] = self._rejection_sample(items[i], ks[i], target_probs[j : j + 1])
        return out

    @staticmethod
    def _rejection_sample(item: VerifyItem, k: int, target_probs: torch.Tensor) -> list[int]:  # [1, K'+1, V]
        if k == 0:  # a plain row: rejection sampling with K=0 is sampling p at the bonus position
            return sample_categorical(target_probs[:, 0], item.generator).tolist()
        ids = torch.tensor([item.proposal.token_ids], dtype=torch.long)  # [1, K]
        q = _draft_probs(item.proposal, target_probs.shape[-1]).unsqueeze(0)  # [1, K, V]
        toks = rejection_sample_unchecked(ids, q, target_probs[:, : k + 1], item.generator)[0]
        return toks[toks >= 0].tolist()


def _draft_probs(proposal: Proposal, vocab: int) -> torch.Tensor:  # [K, V]
    """q of a proposal: the draft's distributions, or one-hot for a deterministic proposer."""
    k = len(proposal.token_ids)
    if proposal.probs is not None:
        return proposal.probs.to(torch.float32)
    q = torch.zeros(k, vocab)
    if k:
        q[torch.arange(k), torch.tensor(proposal.token_ids)] = 1.0
    return q
