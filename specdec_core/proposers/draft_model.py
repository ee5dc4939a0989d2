"""Draft-model proposer: a small causal LM proposes K tokens autoregressively, batched.

Leviathan et al. 2023, Algorithm 1, lines 1-4: x_i ~ q(x | prefix, x_1..x_{i-1}) for i = 1..K,
where q is the draft's distribution (p is the target's). The draft runs K forwards per step; the
first one also catches up on what the target emitted since the last step (one recovered or bonus
token, two when all K were accepted, or the whole prompt on the first step: the draft's prefill).

Rollback is implicit (see ``SequenceSlots.sync``): every call carries the authoritative history.
"""

from __future__ import annotations

import torch

from specdec_core.proposers.base import Proposal, ProposalRequest
from specdec_core.runner import ModelRunner
from specdec_core.sampling import process_logits_per_row, sample_categorical
from specdec_core.slots import SequenceSlots


class DraftModelProposer:
    proposes_full_k = True

    def __init__(self, runner: ModelRunner, name: str = "draft"):
        self.runner = runner
        self.name = name
        self.slots = SequenceSlots(runner)

    def num_sequences(self) -> int:
        return len(self.slots)

    def release(self, seq_id: str) -> None:
        self.slots.release(seq_id)

    def propose(self, requests: list[ProposalRequest]) -> list[Proposal]:
        for r in requests:
            if len(r.token_ids) + r.k > self.runner.max_len:
                raise ValueError(f"draft context full: {len(r.token_ids)} tokens + k={r.k} > {self.runner.max_len}")
        feeds = [self.slots.sync(r.seq_id, r.token_ids) for r in requests]
        proposed: list[list[int]] = [[] for _ in requests]
        dists: list[list[torch.Tensor]] = [[] for _ in requests]
        active = [i for i, r in enumerate(requests) if r.k > 0]
        while active:
            ids = [requests[i].seq_id for i in active]
            logits = self.runner.forward(
                [self.slots.slot(s) for s in ids], [feeds[i] for i in active], [1] * len(active)
            )[:, 0]  # [B, V]
            for seq_id, i in zip(ids, active):
                self.slots.fed(seq_id, feeds[i])
            tokens = self._sample(logits, [requests[i] for i in active], [dists[i] for i in active])
            still = []
            for i, token in zip(active, tokens):
                proposed[i].append(token)
                feeds[i] = [token]
                if len(proposed[i]) < requests[i].k:
                    still.append(i)
            active = still
        # Greedy rows keep no distributions: their q is one-hot on the proposed token.
        return [Proposal(toks, torch.stack(d) if d else None) for toks, d in zip(proposed, dists)]

    @staticmethod
    def _sample(logits: torch.Tensor, requests: list[ProposalRequest], dists: list[list]) -> list[int]:
        """Next draft token per row (logits [B, V]); sampled rows also record their q."""
        tokens = logits.argmax(-1).tolist()
        sampled = [row for row, r in enumerate(requests) if r.temperature > 0]
        if sampled:
            probs = process_logits_per_row(logits[sampled], [requests[row] for row in sampled])  # [S, V]
            for j, row in enumerate(sampled):
                tokens[row] = int(sample_categorical(probs[j : j + 1], requests[row].generator)[0])
                dists[row].append(probs[j])
        return tokens
