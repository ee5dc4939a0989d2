"""The proposer interface.

A proposer suggests up to K draft tokens per sequence and the distributions q it drew them from
(Leviathan et al. 2023: q is the draft, p the target). A proposer that returns ``probs=None`` is
deterministic: its q is one-hot on the proposed token (n-gram lookup), which the rejection sampler
handles exactly like any other q.

Proposers keep per-sequence state (a draft KV cache, say) keyed by a sequence id. They receive the
full, authoritative token history on every call and reconcile against it themselves, so a verify
outcome needs no separate rollback message and a lost proposer state costs only a re-prefill.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch


@dataclass
class ProposalRequest:
    seq_id: str
    token_ids: list[int]  # the authoritative history: prompt + every emitted token
    k: int  # how many tokens to propose (the proposer may return fewer)
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    generator: torch.Generator | None = None


@dataclass
class Proposal:
    token_ids: list[int]  # [k'] with k' <= k
    probs: torch.Tensor | None  # [k', V] draft distributions q, or None for a one-hot q


class Proposer(Protocol):
    name: str
    proposes_full_k: bool  # always exactly K tokens (a draft model), or possibly fewer (a lookup)

    def propose(self, requests: list[ProposalRequest]) -> list[Proposal]: ...

    def release(self, seq_id: str) -> None: ...

    def num_sequences(self) -> int: ...
