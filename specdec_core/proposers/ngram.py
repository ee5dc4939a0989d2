"""N-gram prompt-lookup proposer (Saxena 2023, "prompt lookup decoding"; vLLM's ``ngram`` method).

No model: find the most recent earlier occurrence of the sequence's last n tokens (n from
``max_n`` down to ``min_n``) and propose the tokens that followed it. Its cost ratio c is ~0,
so it pays whenever the text repeats itself (code edits, extraction, lists), and proposes
nothing when it does not.
"""

from __future__ import annotations

from specdec_core.proposers.base import Proposal, ProposalRequest


class NgramProposer:
    name = "ngram"
    proposes_full_k = False  # only as many tokens as followed the match

    def __init__(self, min_n: int = 1, max_n: int = 4):
        if not 1 <= min_n <= max_n:
            raise ValueError(f"need 1 <= min_n <= max_n, got {min_n}, {max_n}")
        self.min_n, self.max_n = min_n, max_n

    def propose(self, requests: list[ProposalRequest]) -> list[Proposal]:
        return [Proposal(self._lookup(r.token_ids, r.k), None) for r in requests]

    def _lookup(self, tokens: list[int], k: int) -> list[int]:
        length = len(tokens)
        for n in range(min(self.max_n, length - 1), self.min_n - 1, -1):
            suffix = tokens[length - n :]
            # Most recent match first: recent context predicts the continuation best.
            for start in range(length - n - 1, -1, -1):
                if tokens[start : start + n] == suffix:
                    return tokens[start + n : start + n + k]
        return []

    def release(self, seq_id: str) -> None:  # stateless
        return None

    def num_sequences(self) -> int:
        return 0
