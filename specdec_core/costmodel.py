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

from collections.abc import Sequence
from dataclasses import dataclass, field

from specdec_core.drift import StepDrift
from specdec_core.step_costs import StepCosts

TOPOLOGIES = ("colocated", "separate")

# Acceptance a probe is priced at: "would speculation pay if acceptance were back?"
PROBE_CEILING = 0.95


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
        return t * self._drift_factor(k, batch, topology)

    def _drift_factor(self, k: int, batch: float, topology: str) -> float:
        """``StepDrift.factor``, memoised while the drift stays put (its version): a budgeted plan prices
        ~80 steps of one batch, and the factor's lookups were a quarter of a plan's time."""
        if self.drift is None:
            return 1.0
        memo = self._parts_cache.get("factors")
        if memo is None or memo[0] != self.drift.version:
            memo = self._parts_cache["factors"] = (self.drift.version, {})
        factor = memo[1].get((k, batch, topology))
        if factor is None:
            factor = memo[1][(k, batch, topology)] = self.drift.factor(k, batch, topology)
        return factor

    def draft_time(self, rows: int) -> float:
        """One draft forward over ``rows`` rows (``StepCosts.draft_time``), memoised: a plan asks it per
        position it admits."""
        t = self._parts_cache.get(("draft", rows))
        if t is None:
            t = self._parts_cache[("draft", rows)] = self.costs.draft_time(rows)
        return t

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
            step = self._parts_cache.get(("step", draft_rows, topology))
            if step is None:
                step = self._parts_cache[("step", draft_rows, topology)] = (self.costs.draft_step_time(draft_rows)
                                                                            + self.costs.hop(topology))
            t += draft_s + step
        return t if calibrated else t * self._drift_factor(depth if extra_tokens else 0, batch, topology)

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
        t *= self._drift_factor(k, batch, topology)
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
