"""`specdec-bench regimes`: every regime cell, plain vs fixed-K speculation vs auto (adaptive K),
interleaved, on the shipped model family, next to the cost model's prediction.

Prediction for a cell = plain / speculative time per token from the cost model: the step costs
(t_D0 + K t_D + t_T(K+1) per speculative step, t_T(1) per plain one), calibrated on this machine
at the cell's batch and context length through the engine's own step phases (so framework
overhead is inside them) on a synthetic prompt, priced over the steps the cell's speculative runs
took and divided by the tokens they emitted (``predict``).
"""

from __future__ import annotations

import statistics
import time
from dataclasses import asdict, dataclass, field

import torch
from tqdm import tqdm

from specdec_bench.common import MODELS_DIR, Summary, judged_acceptance, load_prompts, machine_facts
from specdec_core import Engine, SamplingParams
from specdec_core.calibration import calibrate
from specdec_core.costmodel import CostModel
from specdec_core.stats import StepTiming
from specdec_core.step_costs import StepCosts

MODES = ("plain", "spec", "auto")


@dataclass
class Cell:
    regime: str
    draft: str  # model name under models/, or "ngram"
    prompt_set: str
    batch: int
    temperature: float
    max_new_tokens: int
    k: int = 4
    top_p: float = 1.0
    sweep: str | None = None  # cells of a sweep (batch, temperature) also feed the plots
    num_prompts: int = 4


@dataclass
class CellResult:
    regime: str
    draft: str
    batch: int
    temperature: float
    k: int
    plain_tok_s: float
    spec_tok_s: float
    auto_tok_s: float
    speedup: float
    auto_vs_best: float
    acceptance: float
    cost_ratio: float
    predicted_speedup: float
    runs: int
    prompt_set: str = ""
    max_new_tokens: int = 0
    sweep: str | None = None
    plain_ms_per_token: dict = field(default_factory=dict)
    spec_ms_per_token: dict = field(default_factory=dict)
    auto_ms_per_token: dict = field(default_factory=dict)
    auto_mean_k: float = 0.0
    mean_acceptance_length: float = 0.0
    # What auto did, so that a miss explains itself: the share of its decode steps at each K (K=1
    # after plain steps: probes), and its engine's drift at the cell's batch bucket at the end
    # (measured / calibrated step time, plain and speculative: how far its pricing was corrected).
    auto_k_share: dict = field(default_factory=dict)
    auto_drift: dict = field(default_factory=dict)
    auto_vs_best_per_rep: list = field(default_factory=list)  # auto_vs_best is their median


def build_cells(quick: bool, k: int) -> list[Cell]:
    n = 2 if quick else 4
    batches = (1, 8, 32) if quick else (1, 4, 16, 32, 64)
    temps = (0.0, 1.0, 1.5) if quick else (0.0, 0.5, 1.0, 1.5)
    new = 32 if quick else 64
    cells = [
        Cell("favorable", "draft", "prose", 1, 0.0, new, k, num_prompts=n),
        Cell("high_entropy", "draft", "prose", 1, 1.5, new, k, num_prompts=n),
        Cell("expensive_draft", "draft-large", "prose", 1, 0.0, new, k, num_prompts=n),
        Cell("domain_mismatch", "draft-code", "prose", 1, 0.0, new, k, num_prompts=n),
        Cell("large_batch", "draft", "prose", batches[-1], 0.0, new // 2, k, num_prompts=batches[-1]),
        Cell("long_context", "draft", "long", 1, 0.0, new, k, num_prompts=max(1, n // 2)),
        Cell("prefill_heavy", "draft", "long", 1, 0.0, 4, k, num_prompts=n),
        Cell("favorable", "ngram", "repetitive", 1, 0.0, new, k, num_prompts=n),
    ]
    cells += [
        Cell("large_batch" if b > 1 else "favorable", "draft", "prose", b, 0.0, new // 2, k, sweep="batch",
             num_prompts=max(b, n))
        for b in batches[:-1]
    ]
    cells += [
        Cell("high_entropy" if t >= 1.0 else "favorable", "draft", "prose", 1, t, new, k, sweep="temperature",
             num_prompts=n)
        for t in temps if t not in (0.0, 1.5)
    ]
    return cells


class EnginePool:
    """One engine per draft, loaded on first use; each gets its adaptive-K policy once."""

    def __init__(self, models_dir, max_batch: int):
        self.models_dir = models_dir
        self.max_batch = max_batch
        self._engines: dict[str, Engine] = {}

    def get(self, draft: str) -> Engine:
        if draft not in self._engines:
            target = str(self.models_dir / "target")
            if draft == "ngram":
                eng = Engine.from_pretrained(target, proposer="ngram", max_batch_size=self.max_batch,
                                             max_model_len=1024)
            else:
                eng = Engine.from_pretrained(target, str(self.models_dir / draft), max_batch_size=self.max_batch,
                                             max_model_len=1024)
            grid = {"batches": (1, 8, 32, 64), "qs": (1, 2, 3, 5, 9), "long_context_len": 512}
            eng.enable_adaptive(calibrate(eng, **grid), sampled_costs=calibrate(eng, **grid, temperature=1.0))
            self._engines[draft] = eng
        return self._engines[draft]


def _params(cell: Cell, mode: str, seed: int) -> SamplingParams:
    return SamplingParams(
        max_new_tokens=cell.max_new_tokens,
        temperature=cell.temperature,
        top_p=cell.top_p,
        seed=seed,
        ignore_eos=True,  # equal output lengths across modes
        num_speculative_tokens=0 if mode == "plain" else (cell.k if mode == "spec" else 8),
        adaptive_k=mode == "auto",
        domain=cell.prompt_set,
    )


def run_group(engine: Engine, cell: Cell, group: list[list[int]], mode: str, seed_base: int
              ) -> tuple[float, list, list[StepTiming]]:
    """Generate one batch of prompts in one mode; return (wall seconds, outputs, the engine's steps)."""
    params = [_params(cell, mode, seed=seed_base + i) for i in range(len(group))]
    trace: list[StepTiming] = []
    t0 = time.perf_counter()
    outs = engine.generate(group, params=params, trace=trace)
    return time.perf_counter() - t0, outs, trace


@dataclass
class Calibration:
    """Step costs at the cell's batch, context and temperature, and the target's prefill of its
    prompt, timed at one moment."""

    costs: StepCosts
    target_prefill_s: float


def calibrate_cell(engine: Engine, cell: Cell, prompt_len: int) -> Calibration:
    context_len = prompt_len + cell.max_new_tokens // 2
    costs = calibrate(engine, batches=(cell.batch,), qs=tuple(sorted({1, 2, 3, cell.k + 1})),
                      context_len=context_len, temperature=cell.temperature)
    return Calibration(costs, engine.target.time_step(cell.batch, prompt_len, context_len=1, repeats=2))


def predict(cell: Cell, spec_traces: list[list[StepTiming]], prompt_len: int, calibrations: list[Calibration],
            grid: CostModel) -> tuple[float, float]:
    """(predicted speedup of fixed K over plain, cost ratio c) for the cell's whole batches: the
    median over calibrations taken before, during and after the cell's runs (this machine's speed
    drifts by up to a quarter within a minute, and one snapshot put a cell 21% off).

    Decode costs are calibrated through the engine's own step phases at the cell's batch, context
    and temperature (on a synthetic prompt; sampling costs more per step than greedy). The traffic
    enters through the decode steps the speculative runs took: each step s of a batch is priced at
    its widest proposal k_s (a ragged batch verifies every row k_s + 1 wide) and its rows b_s,
        t_spec = sum_s (t_D0 + k_s t_D + t_T(k_s + 1)) at the cell's batch B, times g(b_s, k_s) / g(B, k_s)
    per batch run, where g is the engine's own calibration grid (``grid``): how a step's cost falls
    as rows leave. A batch runs until its slowest row is done: rows that accepted less need more
    steps, and the rows that finished early leave a smaller batch behind. Pricing the mean tokens
    per step instead (what a continuously refilled batch gets) put batches 4-32 16-19% optimistic;
    pricing the tail at the full batch's cost, 10-24% pessimistic at batch 16-64. Calibrating the
    cell at smaller batches instead would teach the engine's drift there (auto then probed in the
    tail). Per step, because step cost is not linear in k (the mean proposal length overestimated
    the n-gram cell by 20%) and E_K(a) of the per-token acceptance overestimated tokens per step by
    4-10%: acceptance is not independent from position to position. A batch also pays the target's
    prefill, and with speculation the draft's prefill, which short outputs cannot amortise
    (prefill-heavy). Plain batches have no ragged tail: every row takes max_new - 1 steps.
    """
    decode = cell.max_new_tokens - 1  # the first token comes from the target's prefill
    steps = [s for trace in spec_traces for s in trace if not s.prefill_rows]
    tail = [grid.spec_step_time(s.batch, s.k) / grid.spec_step_time(cell.batch, s.k) for s in steps]
    speedups, ratios = [], []
    for cal in calibrations:
        model = CostModel(cal.costs)
        t_decode = sum(model.spec_step_time(cell.batch, s.k) * f for s, f in zip(steps, tail))
        draft_prefill = cal.costs.draft_prefill_s_per_token * prompt_len * cell.batch
        plain = cal.target_prefill_s + decode * model.plain_time_per_token(cell.batch)
        spec = cal.target_prefill_s + draft_prefill + t_decode / len(spec_traces)
        speedups.append(plain / spec)
        ratios.append(model.cost_ratio(cell.batch))
    return statistics.median(speedups), statistics.median(ratios)


def run_cell(pool: EnginePool, cell: Cell, reps: int) -> CellResult:
    engine = pool.get(cell.draft)
    prompts = load_prompts(cell.prompt_set, models_dir=pool.models_dir)
    prompts = (prompts * (cell.num_prompts // len(prompts) + 1))[: cell.num_prompts]
    cap = engine.max_model_len - cell.max_new_tokens - 16
    prompts = [engine.encode(p)[-cap:] for p in prompts]
    prompt_len = int(statistics.mean(len(p) for p in prompts))
    for mode in MODES:  # warm-up: caches, allocator, and auto's acceptance statistics
        run_group(engine, cell, prompts[: cell.batch], mode, seed_base=1000)
    ms_tok = {m: [] for m in MODES}
    outs_by_mode = {m: [] for m in MODES}
    groups = [prompts[start : start + cell.batch] for start in range(0, len(prompts), cell.batch)]
    walls = {m: [[] for _ in groups] for m in MODES}  # [mode][group] -> seconds per rep
    tokens = {m: [0] * len(groups) for m in MODES}  # equal in every rep: ignore_eos
    spec_traces: list[list[StepTiming]] = []  # every speculative batch run's engine steps
    calibrations = [calibrate_cell(engine, cell, prompt_len)]  # before, half-way and after the reps
    for rep in range(reps):
        if rep == reps // 2 and rep > 0:
            calibrations.append(calibrate_cell(engine, cell, prompt_len))
        # Modes take turns group by group (order rotating), so the machine's drift over a cell
        # (other tenants, clocks) falls on all three alike instead of on whichever ran last.
        for g, group in enumerate(groups):
            shift = (rep + g) % len(MODES)
            for mode in MODES[shift:] + MODES[:shift]:
                seconds, outs, trace = run_group(engine, cell, group, mode, seed_base=1000 + g * cell.batch)
                if mode == "spec":
                    spec_traces.append(trace)
                walls[mode][g].append(seconds)
                tokens[mode][g] = sum(len(o.token_ids) for o in outs)
                outs_by_mode[mode] += outs
        for mode in MODES:
            wall = sum(w[-1] for w in walls[mode])
            # per request: its group's wall time over its tokens
            ms_tok[mode].append(1000 * wall / len(groups) / (sum(tokens[mode]) / len(prompts)))
    spec_outs, auto_outs = outs_by_mode["spec"], outs_by_mode["auto"]
    acceptance = judged_acceptance(spec_outs)
    calibrations.append(calibrate_cell(engine, cell, prompt_len))
    view = engine.adaptive.view
    grid = CostModel(view.costs if cell.temperature <= 0 else view.sampled_costs)  # without the drift
    predicted, ratio = predict(cell, spec_traces, prompt_len, calibrations, grid)
    # Each group's median over reps: a burst from another tenant hits one group run, not a whole rep.
    med = {m: sum(tokens[m]) / sum(statistics.median(w) for w in walls[m]) for m in MODES}
    # Auto against the better mode rep by rep: within a rep the modes ran seconds apart, so the
    # machine's drift over a cell (up to a quarter within a minute) cancels from each ratio, which a
    # ratio of the modes' medians (taken at different moments) keeps.
    best = max(("plain", "spec"), key=med.get)
    per_rep = {m: [sum(tokens[m]) / sum(w[r] for w in walls[m]) for r in range(reps)] for m in MODES}
    auto_vs_best = [a / b for a, b in zip(per_rep["auto"], per_rep[best])]
    verify_steps = sum(o.stats.verify_steps for o in auto_outs)
    all_steps = verify_steps + sum(o.stats.plain_steps for o in auto_outs)
    drift = engine.adaptive.view.drift
    bucket = drift.buckets.get(drift.bucket(cell.batch))
    return CellResult(
        regime=cell.regime,
        draft=cell.draft,
        batch=cell.batch,
        temperature=cell.temperature,
        k=cell.k,
        plain_tok_s=med["plain"],
        spec_tok_s=med["spec"],
        auto_tok_s=med["auto"],
        speedup=med["spec"] / med["plain"],
        auto_vs_best=statistics.median(auto_vs_best),
        auto_vs_best_per_rep=auto_vs_best,
        acceptance=acceptance,
        cost_ratio=ratio,
        predicted_speedup=predicted,
        runs=reps,
        prompt_set=cell.prompt_set,
        max_new_tokens=cell.max_new_tokens,
        sweep=cell.sweep,
        plain_ms_per_token=Summary.of(ms_tok["plain"]).as_dict(),
        spec_ms_per_token=Summary.of(ms_tok["spec"]).as_dict(),
        auto_ms_per_token=Summary.of(ms_tok["auto"]).as_dict(),
        auto_mean_k=sum(o.stats.proposed for o in auto_outs) / all_steps if all_steps else 0.0,
        auto_k_share=_decode_k_share(auto_outs),
        auto_drift=asdict(bucket) if bucket is not None else {},
        mean_acceptance_length=(
            sum(o.stats.accepted + o.stats.verify_steps for o in spec_outs)
            / max(1, sum(o.stats.verify_steps for o in spec_outs))
        ),
    )


def _decode_k_share(outs) -> dict[int, float]:
    """Share of the requests' decode steps at each K (their prefill passes left out)."""
    steps: dict[int, int] = {}
    for o in outs:
        for k, n in enumerate(o.stats.proposal_lengths):
            steps[k] = steps.get(k, 0) + n - (k == 0)  # the prefill's pass counts as a plain step
    total = sum(steps.values())
    return {k: n / total for k, n in sorted(steps.items()) if n} if total else {}


def run_regimes(args) -> dict:
    torch.set_num_threads(args.threads)
    models_dir = args.models or MODELS_DIR
    cells = build_cells(args.quick, args.k)
    if args.only:
        cells = [c for c in cells if c.regime in args.only or c.draft in args.only]
    reps = args.reps or (2 if args.quick else 10)  # full: 10, the 5% auto criterion sits within noise of 5
    pool = EnginePool(models_dir, max_batch=max(c.batch for c in cells))
    results = []
    for cell in tqdm(cells, desc="regime cells", unit="cell"):
        results.append(run_cell(pool, cell, reps))
        r = results[-1]
        tqdm.write(
            f"{r.regime:16s} {r.draft:12s} b={r.batch:<3d} T={r.temperature:<4} plain {r.plain_tok_s:7.1f} "
            f"spec {r.spec_tok_s:7.1f} auto {r.auto_tok_s:7.1f} tok/s  speedup {r.speedup:.2f} "
            f"(pred {r.predicted_speedup:.2f})  a={r.acceptance:.2f} c={r.cost_ratio:.2f} "
            f"auto/best {r.auto_vs_best:.2f}"
        )
    return {
        "machine": machine_facts(args.threads),
        "config": {"quick": args.quick, "k": args.k, "reps": reps, "models": str(models_dir)},
        "cells": [asdict(r) for r in results],
    }
