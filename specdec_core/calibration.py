"""Calibration: measure one target/draft pair's step costs on this hardware, through an engine's own steps.

Vocabulary (``costmodel.py``'s): b is the batch, K the draft tokens a step proposes, q = K+1 the
verify width. t_T(b, q) is a step's verify phase (target forward + sampling + bookkeeping), t_D(b)
one draft token's share of its propose phase, and the draft's step cost the rest of that phase
(``StepCosts.draft_step_s``: its first forward also feeds the last verify's tokens); a context
slope is the extra seconds per cached token per row, per batch and verify width (``StepCosts.at_context``).

``calibrate`` drives an idle engine through fixed-K steps on a synthetic prompt; ``cost_grid``
(pure) assembles the timings into a ``StepCosts``, ``fit_draft_cost`` splits the propose phase
into t_D and the step cost.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import statistics
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING

from specdec_core.proposers import Proposal, ProposalRequest
from specdec_core.request import SamplingParams
from specdec_core.step_costs import DEFAULT_BATCHES, DEFAULT_HOP_OVERHEAD_S, DEFAULT_QS, StepCosts

if TYPE_CHECKING:
    from specdec_core.engine import Engine

# Decode steps run untimed after a prefill: the first ones after it run slow while the caches fill with the
# weights and the rows' KV again. On an Intel Xeon host (L3 300 MiB) the memory-bound family's batch-8 plain
# steps took 10-11 ms for the first three and settled at 6.0 after ~6 (context 64; 15.6 -> 9.8 over ~12 at
# context 320), so a grid timed on the first three priced batch-8 steps 1.5x what served steps took, and its
# context slopes (the same few steps at 256) came out steep
WARMUP_STEPS = 8


def calibrate(
    engine: Engine, batches=(1, 2, 4, 8, 16, 32), qs=(1, 2, 3, 5, 9), context_len: int = 64, steps: int = 6,
    temperature: float = 0.0, long_context_len: int | None = None, sweeps: int = 2,
) -> StepCosts:
    """Measure step costs on this hardware through the engine's own code paths (seconds).

    For each batch b and verify width q = K+1, b requests decode with fixed K on a periodic
    prompt (so every proposer proposes all K tokens): t_T(b, q) is the verify phase of a step,
    t_D(b) the propose phase per draft token. The framework overhead is thereby inside the costs,
    as it is inside real steps. With ``temperature`` > 0 the steps take the sampling path (draft
    distributions, the rejection sampler), which costs more per step than greedy argmaxes. With
    ``long_context_len`` every batch's steps are timed again at that context (the narrowest and the
    widest verify), which gives the per-token context slopes. The engine must be idle.

    The grid is swept ``sweeps`` times, ``steps / sweeps`` steps a cell each time, and each cell
    keeps its fastest sweep: noise only adds time, and a burst of it on a shared machine covers a
    run of consecutive cells. A served replica calibrates while the others load and measure their
    kernels: one sweep there timed every batch-1 verify wider than one token 1.4-1.7x too slow
    (t_T(1, 2) = 19.3 ms against 11.2 ms for t_T(1, 1); 13-14 ms in a quiet process), which made
    K=6 look best where K=4 won by 8% served, and the per-host cache kept it across restarts.
    """
    if engine.has_work():
        raise RuntimeError("calibrate needs an idle engine")
    batches = [b for b in batches if b <= min(engine.max_batch_size, engine.target.num_free_slots)]
    speculative = engine.proposer is not None and max(qs) > 1
    draft_phase: dict[int, dict[int, float]] = {}  # batch -> K -> seconds of the step's draft phase (fastest sweep)
    verify_s: dict[tuple[int, int], float] = {}  # (batch, q) -> seconds of the verify (fastest sweep)

    def sweep() -> None:
        for b in batches:
            for q in qs:
                verify, propose = _time_steps(engine, b, q - 1, context_len, max(2, steps // sweeps), temperature)
                verify_s[b, q] = min(verify, verify_s.get((b, q), math.inf))
                if q > 1:
                    phases = draft_phase.setdefault(b, {})
                    phases[q - 1] = min(propose, phases.get(q - 1, math.inf))

    @functools.cache
    def draft_fit(b: int) -> tuple[float, float]:  # (per token, per step): one fit per batch
        return fit_draft_cost(list(draft_phase[b].items()))

    time_draft = (lambda b: draft_fit(b)[0]) if speculative else None
    time_draft_step = (lambda b: draft_fit(b)[1]) if speculative else None
    proposer = engine.proposer
    if speculative and not proposer.proposes_full_k:
        # A lookup finds no match in the synthetic prompt's continuation and would propose
        # nothing, so the "K+1" verifies would be plain steps: time full-width verifies instead,
        # on an engine of their own over the same target.
        engine = engine.sibling(_FullWidthProposer())
    for _ in range(sweeps):
        sweep()
    costs = cost_grid(lambda b, q: verify_s[b, q], time_draft, batches=batches, qs=qs,
                      time_draft_step=time_draft_step)
    costs = dataclasses.replace(costs, context_len=context_len)
    if speculative and 2 in qs:
        costs = dataclasses.replace(costs, one_extra_s=_one_extra(engine, costs, context_len, steps, temperature))
    if speculative:
        costs = dataclasses.replace(costs, ragged_s=_ragged(engine, costs, context_len, steps, temperature, sweeps))
    long_context_len = min(long_context_len or 0, engine.max_model_len - (steps + 3 + WARMUP_STEPS) * max(qs))
    if long_context_len > context_len:
        costs = _context_slopes(engine, costs, qs, long_context_len, steps, temperature, sweeps)
    runner = getattr(proposer, "runner", None)
    if speculative and runner is not None:
        prefill_tokens = min(256, runner.max_len - 1)
        per_token = runner.time_step(1, prefill_tokens, context_len=1, repeats=2) / prefill_tokens
        costs = dataclasses.replace(costs, draft_prefill_s_per_token=per_token)
    return costs


def _one_extra(engine: Engine, costs: StepCosts, context_len: int, steps: int, temperature: float
               ) -> tuple[float, ...]:
    """Per batch, the verify with one row at K=1 and the rest plain (``StepCosts.one_extra_s``), kept
    between the plain step and the two-token one (noise only adds time; more tokens never cost less)."""
    out = []
    for b, row in zip(costs.batches, costs.target_s):
        plain, two = row[0], costs.target_time(b, 2)
        if b == 1:
            out.append(two)
            continue
        verify, _ = _time_steps(engine, b, 0, context_len, steps, temperature, ks=[1] + [0] * (b - 1))
        out.append(min(max(verify, plain), two))
    return tuple(out)


def _ragged(engine: Engine, costs: StepCosts, context_len: int, steps: int, temperature: float, sweeps: int
            ) -> tuple[float, ...]:
    """Per batch, a verify with half its rows at K (the widest calibrated up to 4) and half plain against
    the grid's uniform verify of the same tokens (``StepCosts.ragged_s``): the packed forward's own cost.
    Swept over the batches ``sweeps`` times, each keeping its fastest, as the grid's cells are (a burst of
    noise covers consecutive timings: two back to back at one batch measured 4.7 ms where others gave 0.5)."""
    k = max(q for q in costs.qs if q <= 5) - 1
    fastest = {b: math.inf for b in costs.batches if b > 1 and k >= 1}
    for _ in range(sweeps):
        for b in fastest:
            ks = [k] * (b // 2) + [0] * (b - b // 2)
            verify, _ = _time_steps(engine, b, 0, context_len, max(2, steps // sweeps), temperature, ks=ks)
            fastest[b] = min(fastest[b], verify)
    return tuple(max(0.0, fastest[b] - costs.ragged_target_time(b, k * (b // 2))) if b in fastest else 0.0
                 for b in costs.batches)


def _context_slopes(
    engine: Engine, costs: StepCosts, qs, long_context_len: int, steps: int, temperature: float, sweeps: int = 2
) -> StepCosts:
    """``costs`` plus the per-token context slopes (``StepCosts.context_slope_s``): every batch's steps
    timed again at ``long_context_len`` at the narrowest and widest verify, the widths between on the
    line through them (attention over a long context costs a + b q in the verify width q: linear on
    this CPU, where it is compute bound, and flat where the read dominates). Swept ``sweeps`` times, each
    timing keeping its fastest, as the grid's cells do: one timing against the grid's fastest put a
    burst of noise in the slope (batch 2 priced 17.8 ms at context 256 where its steps took 10.8: 19 us
    a token and row where the fastest of a few timings gave 1.4)."""
    extra = long_context_len - costs.context_len
    ends = (qs[0], qs[-1])
    fastest: dict[tuple[int, int], tuple[float, float]] = {}  # (batch, q) -> (verify, propose) at the long context
    for _ in range(sweeps):
        for b in costs.batches:
            for q in ends:
                timed = _time_steps(engine, b, q - 1, long_context_len, max(2, steps // sweeps), temperature)
                fastest[b, q] = tuple(map(min, timed, fastest.get((b, q), timed)))
    slopes, draft_slopes = [], []
    for b in costs.batches:
        at = {q: max(0.0, fastest[b, q][0] - costs.target_time(b, q)) / (b * extra) for q in ends}
        lo, hi = ends
        slopes.append(tuple(at[lo] + (at[hi] - at[lo]) * (q - lo) / (hi - lo) if hi > lo else at[lo] for q in qs))
        if hi > 1 and engine.proposer is not None:  # the draft's forwards: the widest verify's propose phase
            per_token = (fastest[b, hi][1] - costs.draft_step_time(b)) / (hi - 1)
            draft_slopes.append(max(0.0, per_token - costs.draft_time(b)) / (b * extra))
        else:
            draft_slopes.append(0.0)
    return dataclasses.replace(costs, context_slope_s=tuple(slopes), draft_context_slope_s=tuple(draft_slopes))


def _time_steps(engine: Engine, batch: int, k: int, context_len: int, steps: int, temperature: float = 0.0,
                ks: Sequence[int] | None = None) -> tuple[float, float]:
    """Median (verify seconds, propose seconds) of ``steps`` decode steps at this batch and K (or at
    ``ks``, one K per row: a ragged step), after ``WARMUP_STEPS`` untimed ones (fewer where the engine is too short)."""
    ks = list(ks) if ks is not None else [k] * batch
    width = max(ks) + 1
    # an engine too short for the whole warm-up (a tiny max_model_len) warms up on what it holds beside a prompt
    warmup = max(0, min(WARMUP_STEPS, (engine.max_model_len - min(context_len, 8)) // width - steps - 3))
    params = [SamplingParams(max_new_tokens=(steps + 3 + warmup) * width, temperature=temperature, seed=0,
                             ignore_eos=True, num_speculative_tokens=row_k) for row_k in ks]
    context_len = min(context_len, engine.max_model_len - params[0].max_new_tokens)
    period = [(7 * i + 3) % engine.target.vocab_size for i in range(7)]
    prompt = (period * (context_len // 7 + 1))[:context_len]
    ids = [engine.add_request(prompt, p) for p in params]
    verify, propose = [], []
    try:
        engine.step()  # prefill
        engine.step()  # the draft's catch-up on the prompt
        for _ in range(warmup):
            engine.step()
        for _ in range(steps):
            engine.step()
            verify.append(engine.last_step.verify_s)
            propose.append(engine.last_step.propose_s)
    finally:
        for rid in ids:
            engine.abort(rid)
        engine.step()
    return statistics.median(verify), statistics.median(propose)


class _FullWidthProposer:
    """Calibration stand-in for a proposer that may propose fewer than K tokens: exactly K copies
    of the last token, at ~0 cost (like a lookup's). Verify cost does not depend on which tokens
    are proposed."""

    name = "calibration"
    proposes_full_k = True

    def propose(self, requests: list[ProposalRequest]) -> list[Proposal]:
        return [Proposal([r.token_ids[-1]] * r.k, None) for r in requests]

    def release(self, seq_id: str) -> None:
        return None

    def num_sequences(self) -> int:
        return 0


def cost_grid(
    time_target: Callable[[int, int], float],
    time_draft: Callable[[int], float] | None,
    batches: Sequence[int] = DEFAULT_BATCHES,
    qs: Sequence[int] = DEFAULT_QS,
    hop_overhead_s: Mapping[str, float] = DEFAULT_HOP_OVERHEAD_S,
    time_draft_step: Callable[[int], float] | None = None,
) -> StepCosts:
    """Time every grid point with the given functions (e.g. `runner.time_step`,
    median seconds per forward). time_draft None: a model-free proposer, ~0 s;
    time_draft_step: a speculative step's draft cost beyond K forwards (``StepCosts.draft_step_s``).

    Timing noise on a shared machine only ever adds time, and a forward with more
    tokens or rows is never cheaper, so each measurement is capped by every
    measurement at a larger shape (a suffix minimum along q and along batch): a
    spike at one grid point would otherwise flip the best K (seen: t_T(1, 2) >
    t_T(1, 5) made K=2 look worse than K=4)."""
    target = [_suffix_min([float(time_target(b, q)) for q in qs]) for b in batches]
    columns = [_suffix_min([row[j] for row in target]) for j in range(len(qs))]
    return StepCosts(
        batches=tuple(batches),
        qs=tuple(qs),
        target_s=tuple(tuple(col[i] for col in columns) for i in range(len(batches))),
        draft_s=tuple(_suffix_min([float(time_draft(b)) if time_draft else 0.0 for b in batches])),
        hop_overhead_s=dict(hop_overhead_s),
        draft_step_s=tuple(float(time_draft_step(b)) for b in batches) if time_draft_step else (),
    )


def _suffix_min(values: list[float]) -> list[float]:
    out = list(values)
    for i in range(len(out) - 2, -1, -1):
        out[i] = min(out[i], out[i + 1])
    return out


def fit_draft_cost(points: Sequence[tuple[int, float]]) -> tuple[float, float]:
    """(seconds per draft token, seconds per step) from (K, draft phase seconds) measurements:
    least squares of propose(K) = per_step + K per_token, with per_step >= 0 (a fit below zero
    is noise: then the line through the origin)."""
    ks = [k for k, _ in points]
    if len(set(ks)) > 1:
        mean_k = sum(ks) / len(ks)
        mean_t = sum(t for _, t in points) / len(points)
        slope = sum((k - mean_k) * (t - mean_t) for k, t in points) / sum((k - mean_k) ** 2 for k in ks)
        intercept = mean_t - slope * mean_k
        if intercept >= 0 and slope > 0:
            return slope, intercept
    return sum(k * t for k, t in points) / sum(k * k for k in ks), 0.0
