"""Step costs: seconds per target and draft forward on a (batch, new tokens per row) grid, from timing the
models (``calibration.py``) or from a roofline for hardware we do not have (``roofline.py``), priced at
a context, blended between the greedy and the sampling path, and serialised for calibration files and
replicas. What a step costs, not what it is worth: ``costmodel.CostModel`` prices speculation from it.
Pure: no I/O, no torch.
"""

from __future__ import annotations

import bisect
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

# Per-step orchestration overhead of the separate topology (a propose and a verify message over the
# direct channels, deployments/channel.py): its time per step minus the co-located one at batch 1,
# 1.6-2.2 ms on the CPU machine (`python -m specdec_bench.hops`; 13-15 ms over two Serve handle
# calls before). Its one home: the serving config's `separate_hop_overhead_s` defaults to it.
SEPARATE_HOP_S = 2e-3
DEFAULT_HOP_OVERHEAD_S: Mapping[str, float] = {"colocated": 0.0, "separate": SEPARATE_HOP_S}

DEFAULT_BATCHES = (1, 2, 4, 8, 16, 32, 64)
DEFAULT_QS = (1, 2, 3, 5, 9)  # K+1 for K in {0, 1, 2, 4, 8}


def _interp(xs: Sequence[float], ys: Sequence[float], x: float) -> float:
    """Piecewise linear in x; linear extrapolation from the last two points above
    the grid, flat below it (a forward does not get cheaper than the smallest
    measured shape)."""
    if len(xs) == 1 or x <= xs[0]:
        return ys[0]
    i = min(bisect.bisect_right(xs, x), len(xs) - 1)  # segment [i-1, i]
    x0, x1, y0, y1 = xs[i - 1], xs[i], ys[i - 1], ys[i]
    return y0 + (y1 - y0) * (x - x0) / (x1 - x0)


@dataclass(frozen=True)
class StepCosts:
    """Seconds per forward on a (batch, new tokens per row) grid.

    target_s[i][j]: target forward at batch batches[i] with qs[j] new tokens per row.
    draft_s[i]: draft forward at batch batches[i], one new token (zeros for a
    model-free proposer such as n-gram lookup).
    draft_step_s[i]: what a speculative step's draft phase costs beyond K draft_s (empty:
    nothing): its first forward also feeds the last verify's tokens (the recovered or bonus
    token, and the last draft token when all K were accepted) and runs after the target's pass
    has taken the cache. Measured here at batch 1: propose(K) ~ 0.45 + 0.85 K ms, so a cost
    per token fitted across K undercharged K=1 by ~5% of a step and overcharged K=8.
    hop_overhead_s: extra seconds per speculative step, by topology.
    overlapped: the topologies whose draft can propose the next round while the target verifies
    (the separate topology's loop, where that pays: ``CostModel.overlap_pays``).
    """

    batches: tuple[int, ...]
    qs: tuple[int, ...]
    target_s: tuple[tuple[float, ...], ...]
    draft_s: tuple[float, ...]
    hop_overhead_s: Mapping[str, float] = field(default_factory=lambda: dict(DEFAULT_HOP_OVERHEAD_S), hash=False)
    source: str = "measured"
    # Draft prefill, seconds per prompt token: what a speculative request pays once before its
    # first proposal (the prefill-heavy regime: short outputs cannot amortise it).
    draft_prefill_s_per_token: float = 0.0
    # The grid is measured at context_len cached tokens per row. Beyond it each row's attention
    # costs context_slope_s[i][j] more seconds per context token at batches[i], qs[j] new tokens (the
    # draft draft_context_slope_s[i]; a bounded draft's is ~0 past its window): the long-context
    # regime. Per batch, since a row's share of the read is not the same at every batch (here batch 8
    # at context 2000 read its KV ~2x faster per row than batch 1). A flat per-q tuple (a float for
    # the draft) means the same slope at every batch.
    context_len: int = 64
    context_slope_s: tuple = ()
    draft_context_slope_s: tuple | float = ()
    draft_step_s: tuple[float, ...] = ()
    overlapped: tuple[str, ...] = ("separate",)
    # One ragged verify per batch: one row at two tokens, the rest at one (empty: not measured). A
    # verify's cost is a staircase in its tokens where the hardware has one: here a batch-16 forward
    # of 17 tokens cost 1.9x one of 16 (attention leaves the one-token kernel), 32 tokens hardly more.
    one_extra_s: tuple[float, ...] = ()
    # Per batch, what a verify whose rows are at different widths (the runner's packed forward) costs
    # beyond a uniform verify of the same tokens (empty: nothing): here ~0.5 ms at batch 2, ~1 ms at
    # 4-8 and 2-3 ms at 16, 5-10% of the step; priced as uniform, plans with unequal rows were cheap.
    ragged_s: tuple[float, ...] = ()

    def __post_init__(self) -> None:
        if list(self.batches) != sorted(set(self.batches)) or list(self.qs) != sorted(set(self.qs)):
            raise ValueError("batches and qs must be strictly increasing")
        if len(self.target_s) != len(self.batches) or any(len(r) != len(self.qs) for r in self.target_s):
            raise ValueError("target_s must be len(batches) x len(qs)")
        if len(self.draft_s) != len(self.batches):
            raise ValueError("draft_s must have one entry per batch")
        if self.draft_step_s and len(self.draft_step_s) != len(self.batches):
            raise ValueError("draft_step_s must have one entry per batch")
        slopes = self.context_slope_s
        if slopes and not isinstance(slopes[0], (tuple, list)):  # per q, the same at every batch
            slopes = (tuple(slopes),) * len(self.batches)
        object.__setattr__(self, "context_slope_s", tuple(tuple(float(x) for x in row) for row in slopes))
        draft = self.draft_context_slope_s
        if isinstance(draft, (int, float)):
            draft = (float(draft),) * len(self.batches) if draft else ()
        object.__setattr__(self, "draft_context_slope_s", tuple(float(x) for x in draft))
        if self.context_slope_s and (len(self.context_slope_s) != len(self.batches)
                                     or any(len(r) != len(self.qs) for r in self.context_slope_s)):
            raise ValueError("context_slope_s must be len(batches) x len(qs) (or one entry per q)")
        if self.draft_context_slope_s and len(self.draft_context_slope_s) != len(self.batches):
            raise ValueError("draft_context_slope_s must have one entry per batch (or be one number)")
        if self.one_extra_s and len(self.one_extra_s) != len(self.batches):
            raise ValueError("one_extra_s must have one entry per batch")
        if self.ragged_s and len(self.ragged_s) != len(self.batches):
            raise ValueError("ragged_s must have one entry per batch")

    def at_context(self, context_len: int) -> StepCosts:
        """The same grid priced at ``context_len`` cached tokens per row (never below the measured one)."""
        extra = context_len - self.context_len
        if extra <= 0 or not (self.context_slope_s or self.draft_context_slope_s):
            return self
        slopes = self.context_slope_s or ((0.0,) * len(self.qs),) * len(self.batches)
        draft = self.draft_context_slope_s or (0.0,) * len(self.batches)
        return replace(
            self,
            target_s=tuple(tuple(t + b * extra * s for t, s in zip(row, slope_row))
                           for b, row, slope_row in zip(self.batches, self.target_s, slopes)),
            draft_s=tuple(t + b * extra * s for b, t, s in zip(self.batches, self.draft_s, draft)),
            one_extra_s=tuple(t + b * extra * _interp(self.qs, slope_row, 1.0 + 1.0 / b)
                              for b, t, slope_row in zip(self.batches, self.one_extra_s, slopes)),
            context_len=context_len,
        )

    def blend(self, other: StepCosts, weight: float) -> StepCosts:
        """These costs moved ``weight`` of the way to ``other``'s (calibrated on the same grid): a batch
        whose rows take two paths (``verifier.py`` verifies greedy rows by argmax and sampled rows by
        rejection sampling, in one step) costs in between, by its share of each."""
        if (self.batches, self.qs, self.context_len) != (other.batches, other.qs, other.context_len):
            raise ValueError("blended costs must share one grid (batches, qs, context)")

        def mix(a, b):
            if isinstance(a, tuple) and a and isinstance(a[0], tuple):
                return tuple(mix(x, y) for x, y in zip(a, b, strict=True))
            if isinstance(a, tuple):
                if len(a) != len(b):
                    raise ValueError("blended costs must measure the same parts")
                return tuple(x + weight * (y - x) for x, y in zip(a, b))
            return a + weight * (b - a)

        return replace(
            self, target_s=mix(self.target_s, other.target_s), draft_s=mix(self.draft_s, other.draft_s),
            hop_overhead_s={t: mix(h, other.hop_overhead_s.get(t, h)) for t, h in self.hop_overhead_s.items()},
            draft_prefill_s_per_token=mix(self.draft_prefill_s_per_token, other.draft_prefill_s_per_token),
            context_slope_s=mix(self.context_slope_s, other.context_slope_s),
            draft_context_slope_s=mix(self.draft_context_slope_s, other.draft_context_slope_s),
            draft_step_s=mix(self.draft_step_s, other.draft_step_s),
            one_extra_s=mix(self.one_extra_s, other.one_extra_s), ragged_s=mix(self.ragged_s, other.ragged_s),
        )

    def target_time(self, batch: float, q: int) -> float:
        """t_T(b, q): interpolate along q in each grid row, then along batch."""
        per_batch = [_interp(self.qs, row, q) for row in self.target_s]
        return _interp(self.batches, per_batch, batch)

    def ragged_target_time(self, batch: float, extra_tokens: float, uneven: bool = False) -> float:
        """A verify of ``batch`` rows and ``extra_tokens`` tokens beyond one per row: the grid at the
        mean width, except below one extra token per row, where the measured first step of the
        staircase (``one_extra_s``) starts the line to two tokens a row. Less than one token (an
        expected count: a proposer that delivers some of what it is asked) is that share of the step.
        ``uneven``: the rows are at different widths, a packed forward (``ragged_s`` more; the first
        step of the staircase is one already)."""
        if 0 < extra_tokens < 1:
            plain = self.target_time(batch, 1.0)
            return plain + (self.ragged_target_time(batch, 1.0, uneven) - plain) * extra_tokens
        surcharge = self.ragged_surcharge(batch) if uneven and extra_tokens > 0 else 0.0
        if not self.one_extra_s or extra_tokens <= 0 or extra_tokens >= batch:
            return self.target_time(batch, 1.0 + extra_tokens / batch) + surcharge
        first = _interp(self.batches, self.one_extra_s, batch)
        full = self.target_time(batch, 2) + surcharge
        return first + (full - first) * (extra_tokens - 1) / max(1.0, batch - 1)

    def ragged_surcharge(self, batch: float) -> float:
        """What a verify of rows at different widths costs beyond the uniform one of its tokens (``ragged_s``)."""
        return _interp(self.batches, self.ragged_s, batch) if self.ragged_s else 0.0

    def draft_time(self, batch: float) -> float:
        """t_D(b): one draft forward, one new token per row."""
        return _interp(self.batches, self.draft_s, batch)

    def draft_step_time(self, batch: float) -> float:
        """A speculative step's draft cost beyond K forwards (``draft_step_s``)."""
        return _interp(self.batches, self.draft_step_s, batch) if self.draft_step_s else 0.0

    def hop(self, topology: str) -> float:
        if topology not in self.hop_overhead_s:
            raise ValueError(f"no hop overhead for topology {topology!r}")
        return self.hop_overhead_s[topology]

    def to_dict(self) -> dict[str, Any]:
        return {
            "batches": list(self.batches),
            "qs": list(self.qs),
            "target_s": [list(r) for r in self.target_s],
            "draft_s": list(self.draft_s),
            "hop_overhead_s": dict(self.hop_overhead_s),
            "source": self.source,
            "draft_prefill_s_per_token": self.draft_prefill_s_per_token,
            "context_len": self.context_len,
            "context_slope_s": [list(r) for r in self.context_slope_s],
            "draft_context_slope_s": list(self.draft_context_slope_s),
            "draft_step_s": list(self.draft_step_s),
            "overlapped": list(self.overlapped),
            "one_extra_s": list(self.one_extra_s),
            "ragged_s": list(self.ragged_s),
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> StepCosts:
        return cls(
            batches=tuple(int(b) for b in d["batches"]),
            qs=tuple(int(q) for q in d["qs"]),
            target_s=tuple(tuple(float(t) for t in r) for r in d["target_s"]),
            draft_s=tuple(float(t) for t in d["draft_s"]),
            hop_overhead_s={k: float(v) for k, v in d.get("hop_overhead_s", DEFAULT_HOP_OVERHEAD_S).items()},
            source=str(d.get("source", "measured")),
            draft_prefill_s_per_token=float(d.get("draft_prefill_s_per_token", 0.0)),
            context_len=int(d.get("context_len", 64)),
            context_slope_s=tuple(tuple(r) if isinstance(r, list) else r for r in d.get("context_slope_s", ())),
            draft_context_slope_s=(tuple(d["draft_context_slope_s"]) if isinstance(d.get("draft_context_slope_s"), list)
                                   else float(d.get("draft_context_slope_s", 0.0))),
            draft_step_s=tuple(float(t) for t in d.get("draft_step_s", ())),
            overlapped=tuple(d.get("overlapped", ("separate",))),
            one_extra_s=tuple(float(t) for t in d.get("one_extra_s", ())),
            ragged_s=tuple(float(t) for t in d.get("ragged_s", ())),
        )
