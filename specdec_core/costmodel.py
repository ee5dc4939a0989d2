"""Cost model: when does speculation pay, and with which K.

Vocabulary (Leviathan et al. 2023, arXiv 2211.17192):
- a: per-token acceptance rate of draft tokens by the target.
- K: number of speculative tokens the draft proposes per step.
- E_K(a) = (1 - a^(K+1)) / (1 - a): expected tokens emitted per target pass,
  counting the one recovered (after a rejection) or bonus (all K accepted) token.
- c: cost ratio t_D / t_T of one draft forward to one target forward.
- Theorem 3.8: speedup = E_K(a) / (K c + 1), assuming a K+1-token verify costs
  one plain step. Corollary 3.9: some K gives a speedup iff a > c.

The serving model drops Theorem 3.8's assumption and uses measured costs:
    plain:        t_T(b, 1) per token
    speculative:  (K t_D(b) + t_T(b, K+1) + h_topology) / E_K(a) per token
where b is the batch the request runs in and h the per-step hop overhead of the
topology ("colocated": draft and target in one process; "separate": two Ray
handle calls per step). A K+1-token verify is ~1.5x a plain step at batch 1 and
3-4x at batch 32-128 on CPU (docs/ARCHITECTURE.md, Facts), which is what makes
speculation lose at large batch.

Costs come either from timing the models (`specdec_core.calibration`) or, for hardware we do
not have, from a roofline (`specdec_core.roofline.roofline_costs`); both give a
`StepCosts` that the same `CostModel` answers from. `adaptive_k` re-chooses K per step inside a
speculative replica from the same model. Pure: no I/O, no torch.
"""

from __future__ import annotations

import bisect
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from specdec_core.drift import StepDrift

TOPOLOGIES = ("colocated", "separate")

# Per-step orchestration overhead of the separate topology (a propose and a verify message over the
# direct channels, deployments/channel.py): its time per step minus the co-located one at batch 1,
# 1.6-2.2 ms on the CPU machine (`python -m specdec_bench.hops`; 13-15 ms over two Serve handle
# calls before). Its one home: the serving config's `separate_hop_overhead_s` defaults to it.
SEPARATE_HOP_S = 2e-3
DEFAULT_HOP_OVERHEAD_S: Mapping[str, float] = {"colocated": 0.0, "separate": SEPARATE_HOP_S}

DEFAULT_BATCHES = (1, 2, 4, 8, 16, 32, 64)
# Acceptance a probe is priced at: "would speculation pay if acceptance were back?"
PROBE_CEILING = 0.95
DEFAULT_QS = (1, 2, 3, 5, 9)  # K+1 for K in {0, 1, 2, 4, 8}


def expected_tokens_per_step(a: float, k: int) -> float:
    """E_K(a) = (1 - a^(K+1)) / (1 - a), tokens per target pass (bonus/recovered included)."""
    if not 0.0 <= a <= 1.0:
        raise ValueError(f"acceptance rate must be in [0, 1], got {a}")
    if k < 0:
        raise ValueError(f"K must be >= 0, got {k}")
    if a == 1.0:
        return float(k + 1)  # limit of the geometric sum
    return (1.0 - a ** (k + 1)) / (1.0 - a)


def leviathan_speedup(a: float, c: float, k: int) -> float:
    """Theorem 3.8: E_K(a) / (K c + 1); verify assumed to cost one plain step."""
    return expected_tokens_per_step(a, k) / (k * c + 1.0)


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


@dataclass(frozen=True)
class KChoice:
    """k = 0 means plain decoding beats every K >= 1 at this batch and acceptance."""

    k: int
    time_per_token_s: float
    predicted_speedup: float  # plain time per token / this choice's time per token


@dataclass(frozen=True)
class CostModel:
    costs: StepCosts
    # Measured / calibrated step time, learnt while serving (None: the calibration as is).
    drift: StepDrift | None = field(default=None, compare=False)
    # A step's parts (verify, draft phase, hops) depend on (batch, K, topology) only; adaptive K and the
    # separate loop ask per request and step, so they are computed once (a grid interpolation per K
    # was ~0.1 ms a request at batch 16).
    _parts_cache: dict = field(default_factory=dict, init=False, compare=False, repr=False)

    def plain_time_per_token(self, batch: float) -> float:
        return self.spec_step_time(batch, 0)

    def spec_step_time(self, batch: float, k: int, topology: str = "colocated", draft_rows: float | None = None
                       ) -> float:
        """One speculative step: K draft forwards (over ``draft_rows`` rows, default all), one
        K+1-token verify, the hops (K=0: a plain step)."""
        t = self.calibrated_step_time(batch, k, topology, draft_rows)
        return t if self.drift is None else t * self.drift.factor(k, batch, topology)

    def calibrated_step_time(self, batch: float, k: int, topology: str = "colocated",
                             draft_rows: float | None = None) -> float:
        verify, draft, hop = self._step_parts(batch, k, topology, draft_rows)
        return verify + (draft + hop)

    def _step_parts(self, batch: float, k: int, topology: str, draft_rows: float | None = None
                    ) -> tuple[float, float, float]:
        """(K+1-token verify, the draft phase: K forwards and the step's extra, the hops) of one step,
        as calibrated; zeros beside the verify at K=0."""
        key = (batch, k, topology, draft_rows)
        parts = self._parts_cache.get(key)
        if parts is None:
            draft = hop = 0.0
            if k:
                rows = batch if draft_rows is None else draft_rows
                draft, hop = (k * self.costs.draft_time(rows) + self.costs.draft_step_time(rows),
                              self.costs.hop(topology))
            parts = self._parts_cache[key] = (self.costs.target_time(batch, k + 1), draft, hop)
        return parts

    def ragged_step_time(self, batch: int, ks: Sequence[int], topology: str = "colocated",
                         calibrated: bool = False) -> float:
        """One step whose rows propose their own K (``ks``) and verify at their own widths (the
        runner's packed forward): a verify of batch + sum(K) tokens, the draft's j-th forward over the
        rows with K >= j. For a uniform K this is ``spec_step_time``. ``calibrated``: without the drift."""
        depth = max(ks, default=0)
        rows_at = [sum(1 for k in ks if k > j) for j in range(depth)]
        draft_s = sum(self.costs.draft_time(n) for n in rows_at)
        return self.priced_ragged_step(batch, sum(ks), draft_s, rows_at[0] if rows_at else 0, topology, calibrated,
                                       depth, uneven=min(ks, default=0) != depth)

    def priced_ragged_step(self, batch: int, extra_tokens: float, draft_s: float, draft_rows: int,
                           topology: str = "colocated", calibrated: bool = False, depth: int = 1,
                           uneven: bool = False) -> float:
        """``ragged_step_time`` from its parts: ``extra_tokens`` verify tokens beyond one per row (an
        expected count where a lookup proposes some of what it is asked), the draft's forwards
        (``draft_s``), ``draft_rows`` rows drafting, ``depth`` the widest row's K (what the drift
        learns speculative steps by), ``uneven`` whether its rows verify at different widths. The verify
        is priced by its tokens (``StepCosts.ragged_target_time``): its projections cost by tokens, not
        by the widest row; a packed forward costs its surcharge on top."""
        if float(extra_tokens).is_integer():  # a plan prices every width of its batch, step after step
            key = ("ragged", batch, int(extra_tokens), uneven)
            verify = self._parts_cache.get(key)
            if verify is None:
                verify = self._parts_cache[key] = self.costs.ragged_target_time(batch, extra_tokens, uneven)
        else:  # expected counts differ step to step: cached, they would only grow the cache
            verify = self.costs.ragged_target_time(batch, extra_tokens, uneven)
        t = verify
        if extra_tokens:
            t += draft_s + self.costs.draft_step_time(draft_rows) + self.costs.hop(topology)
        return t if calibrated or self.drift is None else t * self.drift.factor(depth if extra_tokens else 0, batch,
                                                                                topology)

    def spec_time_per_token(self, batch: float, k: int, a: float, topology: str = "colocated") -> float:
        """Time per emitted token with K-token speculation: a step over E_K(a) tokens, or the
        overlapped round where the topology overlaps and that is faster."""
        if k == 0:
            return self.plain_time_per_token(batch)
        sequential = self.spec_step_time(batch, k, topology) / expected_tokens_per_step(a, k)
        if topology not in self.costs.overlapped:
            return sequential
        return min(sequential, self.overlapped_time_per_token(batch, k, a, topology))

    def overlapped_time_per_token(self, batch: float, k: int, a: float, topology: str = "separate") -> float:
        """PEARL's post-verify (``deployments/separate_loop.py``): the draft proposes round n+1 from
        the optimistic context while the target verifies round n. A round costs max(D, V) + h, plus a
        fresh proposal D before it when the previous round's overlapped proposal was dropped (the
        target rejected one of its K tokens: probability 1 - a^K); a kept round emits its K tokens
        without the bonus, so a round emits E_K(a) - a^K tokens."""
        verify, draft, hop = self._step_parts(batch, k, topology)
        kept = a**k
        t = max(draft, verify) + (1.0 - kept) * draft + hop
        if self.drift is not None:
            t *= self.drift.factor(k, batch, topology)
        return t / (expected_tokens_per_step(a, k) - kept)

    def overlap_pays(self, batch: float, k: int, a: float, topology: str = "separate") -> bool:
        """Is the overlapped round faster per token than the sequential step? (It is not where the
        draft's wasted rounds, 1 - a^K of them, cost more than the verify time they hide.)"""
        return k > 0 and (self.overlapped_time_per_token(batch, k, a, topology)
                          < self.spec_step_time(batch, k, topology) / expected_tokens_per_step(a, k))

    def best_k(
        self, batch: float, a: float, k_max: int = 8, topology: str = "colocated", allow_plain: bool = True
    ) -> KChoice:
        """K minimising time per token; ties go to the smaller K. With allow_plain,
        K=0 is returned when no K >= 1 beats plain decoding."""
        if not 0.0 <= a <= 1.0:
            raise ValueError(f"acceptance rate must be in [0, 1], got {a}")
        if k_max < 1 and not allow_plain:
            raise ValueError("k_max must be >= 1 when plain is not allowed")
        plain = self.plain_time_per_token(batch)
        best, best_time = (0, plain) if allow_plain else (None, float("inf"))
        for k in range(1, k_max + 1):
            t = self.spec_time_per_token(batch, k, a, topology)
            if t < best_time:
                best, best_time = k, t
        return KChoice(k=best, time_per_token_s=best_time, predicted_speedup=plain / best_time)

    def break_even_batch(self, a: float, k: int, topology: str = "colocated") -> int | None:
        """Smallest integer batch in the grid range where K-token speculation no
        longer beats plain; None if it wins across the whole range."""
        lo, hi = self.costs.batches[0], self.costs.batches[-1]
        for b in range(lo, hi + 1):
            if self.spec_time_per_token(b, k, a, topology) >= self.plain_time_per_token(b):
                return b
        return None

    def cost_ratio(self, batch: float) -> float:
        """c(b) = t_D(b) / t_T(b, 1)."""
        return self.costs.draft_time(batch) / self.plain_time_per_token(batch)


def adaptive_k(
    cost_model: CostModel,
    batch: float,
    acceptance: float,
    k_max: int,
    current_k: int,
    steps_at_current: int = 0,
    topology: str = "colocated",
    hysteresis: float = 0.05,
    probe_every: int = 16,
    probe_k: int = 1,
    probe_ceiling: float = PROBE_CEILING,
) -> int:
    """Per-step re-choice of K for one request inside a speculative replica.

    - Switch from current_k to the best K (0 = plain step, without leaving the
      replica) only if it is faster per token by more than `hysteresis`, so K
      does not flap when two choices are within noise of each other. Leaving
      K = 0, or a K that loses to plain, needs the same margin over plain: a
      probe's few judged tokens must not start marginal speculation.
    - Probe: at K = 0 no position is judged, so the request's acceptance estimate
      freezes at its collapsed value (decay is by judged tokens). After
      `probe_every` steps at K = 0 one step runs at `probe_k` to gather fresh
      evidence; if acceptance has returned, the estimate rises over a few probes
      and K climbs back, otherwise the next call drops to 0 again. No probe
      where no K would pay even at acceptance `probe_ceiling` (an expensive
      draft, a compute-bound batch): a probe then only costs the draft's
      catch-up on the tokens it skipped.
    `steps_at_current` is the caller's count of steps since K last changed.
    """
    best = cost_model.best_k(batch, acceptance, k_max, topology)
    plain_time = cost_model.plain_time_per_token(batch)
    current_time = cost_model.spec_time_per_token(batch, min(current_k, k_max), acceptance, topology)
    if best.k > 0 and (current_k == 0 or current_time > plain_time):
        # Leaving plain decoding, or a K that loses to it (a probe, a fall in acceptance): only for a
        # gain over plain beyond the margin (the router's rule: a predicted speedup above 1 + margin).
        # Near break-even, each switch costs a draft catch-up.
        if best.predicted_speedup > 1.0 + hysteresis:
            return best.k
        best = KChoice(0, plain_time, 1.0)
    if current_k == 0 and best.k == 0:
        if steps_at_current < probe_every:
            return 0
        return probe_k if cost_model.best_k(batch, probe_ceiling, k_max, topology).k > 0 else 0
    if current_k > k_max:
        return best.k
    return best.k if best.time_per_token_s < (1.0 - hysteresis) * current_time else current_k
