"""Budgeted verification: every row's K for one step, chosen for the batch as a whole.

Vocabulary (Leviathan et al. 2023, Algorithm 1): q is the draft's distribution, p the target's; a
verify keeps the *accepted* draft tokens and adds one *recovered* or *bonus* token. A row's draft
position j survives when positions 1..j are all accepted; ``survival[j - 1]`` is that probability,
the product of the row's per-position acceptance rates (``acceptance.position_rates``: acceptance
falls with depth, so one i.i.d. rate misprices deep drafts), and, for a proposer that may return
fewer tokens than asked (a lookup), the share of the row's asks that reached position j
(``acceptance.ProposalCoverage``). A row asked for K tokens emits 1 + survival[0] + ... +
survival[K - 1] tokens on average.

The step's cost is that of one ragged verify (``runner.py``: each row verifies its own K + 1 tokens,
no padding to the widest; rows at different widths pay the packed forward's surcharge,
``StepCosts.ragged_s``) plus the draft's forwards (its j-th forward runs over the rows with K >= j)
(``CostModel.ragged_step_time``). The planner admits draft positions best-survival first (vLLM's
adaptive verification, PR #47808, scores (request, position) pairs the same way) and keeps the prefix
of admissions at which the batch emits tokens fastest: each admission buys its survival in expected
tokens for one more verify token (a staircase where the verify turns compute bound) and, when it
deepens the draft, one more draft row. The walk is repeated under caps on depth: a draft forward is
paid per depth, and the uncapped walk deepens its best rows before it starts the others. Rows with a K
of their own (fixed K, an overlapped proposal, a failed draft at 0) are planned around, not re-chosen.
A row the draft is behind on (a new request's prompt, the tokens of its plain steps) pays for the
catch-up when it starts, spread over the steps it can be expected to speculate for
(``AdaptiveK.plan_budget``). A plan must beat a plain step with that catch-up, and by ``margin`` in its
steps without it (``_clears``): the catch-up is a cost paid once, the margin covers the steps' price. A
plan whose depth has not been measured at its batch runs wherever it beats plain, so that the drift
learns what it costs (a calibration is one draw: at batch 4 one priced K=2 at 1.12x plain where it ran
1.19-1.25x, and the batch ran plain, so nothing measured it). Pure: no torch, no I/O.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from specdec_core.costmodel import CostModel, KChoice

# A plan's steps must beat a plain step's tokens per second by this share. A step's price leaves out a
# closed batch's ragged tail (rows finish at different steps; the last run in a smaller, dearer batch)
# and the calibration's error: at batch 8 on the served family, plans priced 1.09x a plain step measured
# 0.89-0.95x over whole batches.
BUDGET_MARGIN = 0.10


@dataclass(frozen=True)
class StepBudget:
    """What the planner chose for one step, and what it expected the choice to buy."""

    ks: tuple[int, ...]  # per row: draft tokens to propose (0: plain)
    expected_tokens: float  # tokens the batch is expected to emit this step
    step_s: float  # the step's priced time
    plain_step_s: float  # a plain step of the same batch

    @property
    def predicted_speedup(self) -> float:
        """Tokens per second of this step over a plain step's."""
        return (self.expected_tokens / self.step_s) / (len(self.ks) / self.plain_step_s)


def survival(rates: Sequence[float]) -> tuple[float, ...]:
    """[K] P(draft positions 1..j all accepted) from per-position (conditional) acceptance rates."""
    out, alive = [], 1.0
    for rate in rates:
        alive *= rate
        out.append(alive)
    return tuple(out)


def plan_step(model: CostModel, survivals: Sequence[Sequence[float]], fixed: Sequence[int | None],
              topology: str = "colocated", margin: float = BUDGET_MARGIN,
              start_s: Sequence[float] | None = None,
              coverage: Sequence[Sequence[float]] | None = None,
              unmeasured: Callable[[int], bool] | None = None) -> StepBudget:
    """Each row's K: ``survivals[i]`` is row i's survival by position (its length caps its K; empty:
    plain), ``fixed[i]`` a K the row keeps whatever the plan (None: the planner chooses),
    ``start_s[i]`` what row i's first draft position costs beyond a draft forward (its share of the
    draft's catch-up on what it has not seen), ``coverage[i]`` how often row i's proposer delivers
    each position it is asked for (None: always, as a draft model does): a position costs its verify
    token that often (its survival, the caller's, counts that already). Admission by survival alone
    would take a row that must catch up as readily as one that need not, so where some rows must, the
    plan without them is tried too and the faster kept. ``unmeasured(K)``: steps as deep as K have not
    been measured at this batch (``StepDrift.explored``); such a plan runs if it beats a plain step at
    all, margin aside, so that its price is measured and not left to the calibration's draw."""
    batch = len(survivals)
    start_s = list(start_s) if start_s else [0.0] * batch
    coverage = [list(c) for c in coverage] if coverage else [[1.0] * len(s) for s in survivals]
    ks, rate, step_s = _admit(model, survivals, fixed, topology, start_s, coverage)
    if any(start_s):
        in_sync = [0 if t and f is None else f for t, f in zip(start_s, fixed)]
        alternative = _admit(model, survivals, in_sync, topology, start_s, coverage)
        if alternative[1] > rate:
            ks, rate, step_s = alternative
    plain_step = model.plain_time_per_token(batch)
    plain_rate = batch / plain_step
    steady_rate = rate * step_s / (step_s - sum(t for t, k in zip(start_s, ks) if k))
    if any(k for k, f in zip(ks, fixed) if f is None) and not _clears(rate, steady_rate, plain_rate, margin, max(ks),
                                                                       unmeasured):
        ks = [f or 0 for f in fixed]
        step_s = model.ragged_step_time(batch, ks, topology) + sum(t for t, k in zip(start_s, ks) if k)
        rate = (batch + sum(sum(s[:k]) for s, k in zip(survivals, ks))) / step_s
    return StepBudget(tuple(ks), rate * step_s, step_s, plain_step)


def _clears(rate: float, steady_rate: float, plain_rate: float, margin: float, depth: int,
            unmeasured: Callable[[int], bool] | None) -> bool:
    """Does a plan that speculates run? It must beat plain at ``rate`` tokens per second, its rows' catch-up
    included (a cost that is paid, once); its steps (``steady_rate``: without the catch-up) must beat plain
    by the margin (their price's error), unless steps of their depth are unmeasured at this batch."""
    if rate <= plain_rate:
        return False
    return steady_rate >= (1.0 + margin) * plain_rate or unmeasured is not None and unmeasured(depth)


def budgeted_choice(model: CostModel, batch: int, rates: Sequence[float], topology: str = "colocated") -> KChoice:
    """How a pool that plans its steps prices a request: the plan of a step of ``batch`` rows whose
    acceptance by draft position is ``rates`` (its length caps K). ``k``: the widest row's K (0: the
    plan is plain), ``predicted_speedup``: the step's tokens per second over a plain step's. What the
    router routes a budgeted pool's requests by, so that it expects what the replica will do."""
    plan = plan_step(model, [survival(rates)] * batch, [None] * batch, topology)
    k = max(plan.ks, default=0)
    speedup = plan.predicted_speedup if k else 1.0
    return KChoice(k, model.plain_time_per_token(batch) / speedup, speedup)


def _admit(model: CostModel, survivals: Sequence[Sequence[float]], fixed: Sequence[int | None], topology: str,
           start_s: Sequence[float], coverage: Sequence[Sequence[float]]) -> tuple[list[int], float, float]:
    """Draft positions admitted best survival first; (K per row, tokens per second, step seconds) of the
    fastest prefix of admissions, under no cap on depth or any.

    A draft forward is paid per depth, not per row, and one walk by survival deepens the best row before
    it starts the next: beside a row at 0.9, 0.8, one at 0.5 starts after the first has deepened, so both
    rows at K=1 is never priced (the memory-bound family at batch 2 ran (0, 1) steps at 201 tok/s where
    (1, 1) measured 272). So the walk also runs under each cap D on depth: it is the uncapped walk up to
    that walk's first position deeper than D, and goes on from there without them. Caps deeper than one
    past the best plan's are not walked (they drop only what the walks ranked last): at batch 64, walking
    every cap tripled a plan's time, to ~3 ms."""
    batch = len(survivals)
    ks = [f or 0 for f in fixed]
    pricer = _RaggedPricer(model, batch, ks, topology, sum(t for t, k in zip(start_s, ks) if k))
    expected = batch + sum(sum(s[:k]) for s, k in zip(survivals, ks))
    # Candidates (survival, position, row): every free row's positions, best survival first (a row's
    # survival falls with depth, so its positions come in order).
    order = sorted(((s[j], j + 1, i) for i, (s, f) in enumerate(zip(survivals, fixed)) if f is None
                    for j in range(len(s))), key=lambda c: (-c[0], c[1]))
    step_s = pricer.step_s()
    forks: dict[int, tuple] = {}
    best = _walk(order, 0, len(order), ks, expected, pricer, start_s, coverage, (list(ks), expected / step_s, step_s),
                 forks)
    for cap, (at, ks_at, expected_at, pricer_at) in sorted(forks.items()):
        if cap > max(best[0], default=0) + 1:
            break
        best = _walk(order, at, cap, ks_at, expected_at, pricer_at, start_s, coverage, best)
    return best


def _walk(order: list[tuple[float, int, int]], start: int, cap: int, ks: list[int], expected: float,
          pricer: _RaggedPricer, start_s: Sequence[float], coverage: Sequence[Sequence[float]],
          best: tuple[list[int], float, float], forks: dict[int, tuple] | None = None
          ) -> tuple[list[int], float, float]:
    """Admit ``order[start:]``'s positions up to ``cap`` in turn from the plan ``ks`` (``expected`` tokens,
    priced by ``pricer``); ``best``, the fastest plan so far, updated. ``forks``: where given, filled with
    the walk's state before its first position deeper than each depth."""
    left = sum(gain for gain, position, _ in order[start:] if position <= cap)  # expected tokens not admitted
    floor_s = pricer.floor_s()
    for at in range(start, len(order)):
        gain, position, i = order[at]
        if position > cap:
            continue
        # The step costs only more from here (the packed surcharge aside: rows that even out drop it).
        if (expected + left) / floor_s <= best[1]:
            break
        if forks is not None and position > 1 and position - 1 not in forks:
            forks[position - 1] = (at, list(ks), expected, pricer.copy())
        ks[i] += 1
        expected += gain
        left -= gain
        pricer.admit(position, start_s[i] if position == 1 else 0.0, coverage[i][position - 1])
        step_s = pricer.step_s()
        floor_s = pricer.floor_s() if pricer.uneven() else step_s
        if expected / step_s > best[1]:
            best = (list(ks), expected / step_s, step_s)
    return best


class _RaggedPricer:
    """``CostModel.ragged_step_time`` kept up to date one admitted draft position at a time."""

    def __init__(self, model: CostModel, batch: int, ks: list[int], topology: str, start_s: float):
        self.model, self.batch, self.topology = model, batch, topology
        self.extra = sum(ks)  # verify tokens beyond one per row
        depth = max(ks, default=0)
        self.rows_at = [sum(1 for k in ks if k > j) for j in range(depth)]  # [depth] rows drafting at position j + 1
        self.draft_s = sum(model.draft_time(n) for n in self.rows_at) + start_s

    def admit(self, position: int, start_s: float = 0.0, verify_tokens: float = 1.0) -> None:
        """One more draft position (1-based ``position`` of its row, ``start_s`` its row's start cost
        when it is the first, ``verify_tokens`` the tokens it is expected to add to the verify: its
        proposer's coverage there) enters the step."""
        self.extra += verify_tokens
        self.draft_s += start_s
        if position > len(self.rows_at):
            self.rows_at.append(0)
        n = self.rows_at[position - 1]
        draft_time = self.model.draft_time
        self.draft_s += draft_time(n + 1) - (draft_time(n) if n else 0.0)
        self.rows_at[position - 1] = n + 1

    def copy(self) -> _RaggedPricer:
        twin = copy.copy(self)
        twin.rows_at = list(self.rows_at)
        return twin

    def uneven(self) -> bool:
        """Do the rows verify at different widths? (rows_at falls with depth: iff the deepest has fewer)"""
        return bool(self.rows_at) and self.rows_at[-1] < self.batch

    def step_s(self) -> float:
        return self._priced(self.uneven())

    def floor_s(self) -> float:
        """The step as if its rows were even: what admitting more positions cannot make cheaper."""
        return self._priced(uneven=False)

    def _priced(self, uneven: bool) -> float:
        return self.model.priced_ragged_step(self.batch, self.extra, self.draft_s,
                                             self.rows_at[0] if self.rows_at else 0, self.topology,
                                             depth=max(1, len(self.rows_at)), uneven=uneven)
