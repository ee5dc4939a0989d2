"""What a decode step's verify forward costs on this engine, learnt from the steps that ran it alone.

An executor verifies a step's prefill rows in the decode rows' forward: the target streams its weights
once for both (on the memory-bound family a prefill beside a decode step saved 13-47 ms, BENCHMARKS.md).
Who waited for whom must still be told apart: a request's ``decode_s`` and ``prefill_wait_s``, from
which the router learns each pool's step cost, and the drift, which learns steps only. The decode rows'
share of a forward that carried prefills is what their verify costs alone, priced here; the prefills'
share is the rest (``Scheduler.commit``). Split by token share instead, a batch-8 forward of 137 ms
charged its decode rows 27 ms against ~60 ms alone: the weight stream is paid once, whatever the tokens.
Pure: no I/O, no torch.
"""

from __future__ import annotations

from dataclasses import dataclass, field

# A new forward's weight in the fading mean: this host's speed moves by 10-25% over minutes.
NEW_FORWARD_WEIGHT = 0.2


@dataclass
class DecodeClock:
    seconds: dict[tuple[int, int], float] = field(default_factory=dict)  # (rows, verify tokens) -> s

    def observe(self, rows: int, tokens: int, seconds: float) -> None:
        """A verify forward of ``rows`` decode rows and ``tokens`` tokens, nothing else in it, took ``seconds``."""
        old = self.seconds.get((rows, tokens))
        self.seconds[rows, tokens] = seconds if old is None else old + NEW_FORWARD_WEIGHT * (seconds - old)

    def price(self, rows: int, tokens: int) -> float | None:
        """Such a forward alone: as measured at this shape, or at the nearest token count of as many rows
        (a memory-bound verify costs its weight stream, nearly whatever its tokens); None before any."""
        seen = [(abs(t - tokens), t) for r, t in self.seconds if r == rows]
        return self.seconds[rows, min(seen)[1]] if seen else None
