"""Per-sequence KV slot bookkeeping over a ModelRunner.

Every caller (draft proposer, verifier) receives the authoritative token history and calls
``sync``: the slot is rolled back to the longest prefix its cache shares with that history, and the
rest of the history is what must be fed next. This makes rollback after a rejection implicit and
makes a lost or stale cache cost a re-prefill rather than a wrong answer.

A new sequence starts from the longest prefix of its history the runner's prefix cache holds
(``prefix_cache.py``), and a released one leaves its full blocks there.
"""

from __future__ import annotations

from specdec_core.runner import ModelRunner


class SequenceSlots:
    def __init__(self, runner: ModelRunner):
        self.runner = runner
        self._slot: dict[str, int] = {}
        self._cached: dict[str, list[int]] = {}  # tokens whose K/V sit in the slot, in order
        self._verified: dict[str, int] = {}  # prefix of _cached already known to match the history

    def __len__(self) -> int:
        return len(self._slot)

    def __contains__(self, seq_id: str) -> bool:
        return seq_id in self._slot

    def slot(self, seq_id: str) -> int:
        return self._slot[seq_id]

    def sync(self, seq_id: str, history: list[int]) -> list[int]:
        """Roll back to the common prefix with ``history``; return the tokens to feed (at least one)."""
        if seq_id not in self._slot:
            slot = self._slot[seq_id] = self.runner.allocate()
            # The last history token is always fed, so it is never looked up.
            reused = self.runner.reuse_prefix(slot, history[:-1])
            self._cached[seq_id], self._verified[seq_id] = history[:reused], reused
        cached = self._cached[seq_id]
        common = self._verified[seq_id]
        limit = min(len(cached), len(history))
        while common < limit and cached[common] == history[common]:
            common += 1
        # The last history token is always fed: its logits are what the caller needs.
        self.keep(seq_id, min(common, len(history) - 1))
        return history[len(cached):]

    def fed(self, seq_id: str, tokens: list[int]) -> None:
        """Record tokens that a successful forward appended to the slot."""
        self._cached[seq_id].extend(tokens)

    def keep(self, seq_id: str, length: int) -> None:
        """Truncate the slot to its first ``length`` cached tokens (all known to be right)."""
        del self._cached[seq_id][length:]
        self._verified[seq_id] = length
        self.runner.truncate(self._slot[seq_id], length)

    def release(self, seq_id: str) -> None:
        slot = self._slot.pop(seq_id, None)
        if slot is not None:
            self.runner.keep_prefix(slot, self._cached[seq_id])
            self.runner.free(slot)
        self._cached.pop(seq_id, None)
        self._verified.pop(seq_id, None)
