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
deepens the draft, one more draft row. Rows with a K of their own (fixed K, an overlapped proposal,
a failed draft at 0) are planned around, not re-chosen. A row the draft is behind on (a new request's
prompt, the tokens of its plain steps) pays for the catch-up when it starts, spread over the steps
it can be expected to speculate for (``AdaptiveK.plan_budget``). Speculation must beat a plain step
by ``margin`` to run. Pure: no torch, no I/O.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from dataclasses import dataclass

from specdec_core.costmodel import CostModel, KChoice

# The plan must beat a plain step's tokens per second by this share. A step's price leaves out what
# speculation costs beyond its steps: the draft's catch-up when a row starts, and a closed batch's
# ragged tail (rows finish at different steps; the last run in a smaller, dearer batch). At batch 8
# on the served family, plans priced 1.09x a plain step measured 0.89-0.95x over whole batches.
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
              coverage: Sequence[Sequence[float]] | None = None) -> StepBudget:
    """Each row's K: ``survivals[i]`` is row i's survival by position (its length caps its K; empty:
    plain), ``fixed[i]`` a K the row keeps whatever the plan (None: the planner chooses),
    ``start_s[i]`` what row i's first draft position costs beyond a draft forward (its share of the
    draft's catch-up on what it has not seen), ``coverage[i]`` how often row i's proposer delivers
    each position it is asked for (None: always, as a draft model does): a position costs its verify
    token that often (its survival, the caller's, counts that already). Admission by survival alone
    would take a row that must catch up as readily as one that need not, so where some rows must, the
    plan without them is tried too and the faster kept."""
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
    if any(k for k, f in zip(ks, fixed) if f is None) and rate < (1.0 + margin) * batch / plain_step:
        ks = [f or 0 for f in fixed]
        step_s = model.ragged_step_time(batch, ks, topology) + sum(t for t, k in zip(start_s, ks) if k)
        rate = (batch + sum(sum(s[:k]) for s, k in zip(survivals, ks))) / step_s
    return StepBudget(tuple(ks), rate * step_s, step_s, plain_step)


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
    """Draft positions admitted best survival first; (K per row, tokens per second, step seconds) of
    the fastest prefix of admissions."""
    batch = len(survivals)
    ks = [f or 0 for f in fixed]
    expected = batch + sum(sum(s[:k]) for s, k in zip(survivals, ks))
    pricer = _RaggedPricer(model, batch, ks, topology, sum(t for t, k in zip(start_s, ks) if k))
    best_ks, best_rate, best_s = list(ks), expected / pricer.step_s(), pricer.step_s()
    # Candidates: each free row's next position, best survival first (a row's survival falls with depth,
    # so the heap admits a row's positions in order).
    heap = [(-s[0], i) for i, (s, f) in enumerate(zip(survivals, fixed)) if f is None and s]
    heapq.heapify(heap)
    left = sum(sum(s) for s, f in zip(survivals, fixed) if f is None)  # expected tokens not yet admitted
    while heap:
        # The step costs only more from here: even every candidate at the current cost cannot win.
        if (expected + left) / pricer.step_s() <= best_rate:
            break
        gain, i = heapq.heappop(heap)
        ks[i] += 1
        expected -= gain
        left += gain
        pricer.admit(ks[i], start_s[i] if ks[i] == 1 else 0.0, coverage[i][ks[i] - 1])
        if ks[i] < len(survivals[i]):
            heapq.heappush(heap, (-survivals[i][ks[i]], i))
        rate = expected / pricer.step_s()
        if rate > best_rate:
            best_ks, best_rate, best_s = list(ks), rate, pricer.step_s()
    return best_ks, best_rate, best_s


class _RaggedPricer:
    """``CostModel.ragged_step_time`` kept up to date one admitted draft position at a time."""

    def __init__(self, model: CostModel, batch: int, ks: list[int], topology: str, start_s: float):
        self.model, self.batch, self.topology = model, batch, topology
        self.extra = sum(ks)  # verify tokens beyond one per row
        depth = max(ks, default=0)
        self.rows_at = [sum(1 for k in ks if k > j) for j in range(depth)]  # [depth] rows drafting at position j + 1
        self.draft_s = sum(model.costs.draft_time(n) for n in self.rows_at) + start_s

    def admit(self, position: int, start_s: float = 0.0, verify_tokens: float = 1.0) -> None:
        """One more draft position (1-based ``position`` of its row, ``start_s`` its row's start cost
        when it is the first, ``verify_tokens`` the tokens it is expected to add to the verify: its
        proposer's coverage there) enters the step."""
        self.extra += verify_tokens
        self.draft_s += start_s
        if position > len(self.rows_at):
            self.rows_at.append(0)
        n = self.rows_at[position - 1]
        draft_time = self.model.costs.draft_time
        self.draft_s += draft_time(n + 1) - (draft_time(n) if n else 0.0)
        self.rows_at[position - 1] = n + 1

    def step_s(self) -> float:
        return self.model.priced_ragged_step(self.batch, self.extra, self.draft_s,
                                             self.rows_at[0] if self.rows_at else 0, self.topology,
                                             depth=max(1, len(self.rows_at)),
                                             # rows_at falls with depth: rows differ iff the deepest has fewer
                                             uneven=bool(self.rows_at) and self.rows_at[-1] < self.batch)
