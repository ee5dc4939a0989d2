"""`specdec-bench budget`: budgeted verification against plain decoding and every fixed K, in process.

Each cell keeps ``batch`` requests in flight (a finished one is replaced at the next step, as under a
server's steady load) over four requests per slot (``MIN_RUN_TOKENS`` of output at least), each its own
prompt, and is measured over its steady window (until the last request is admitted: the batch full
throughout; ``Run``). The budgeted mode
(``specdec_core/step_planner.py``) chooses each row's K every step for the batch as a whole and
verifies the rows at their own widths (the runner's packed forward). It is measured beside plain,
fixed K = 1, 2, 4, 8 and auto (adaptive K per request, ``adaptive.py``) over a batch sweep of one
traffic, and on mixed batches whose rows differ in acceptance (half repetitive prompts, half free
prose at T=1, over the n-gram proposer and over the distilled draft; half code at T=1, over the n-gram
proposer), where one K for all rows cannot do what a K per row does; for those it reports where each
mode's draft tokens went (``acceptance_by_rows``). Modes are interleaved rep by rep; a cell's tokens/s
is the median over reps. Each mode learns acceptance from its own runs only (a tracker of its own per
cell; auto and the budget warm theirs with one run first), as a server running that mode would.

Predicted, per mode: the steps each run took in its window (each decode step's rows and their K),
priced with the engine's calibration as ragged steps (``CostModel.ragged_step_time``) at the context
each ran at (the calibration has the context slopes a served replica's has), prefills as measured; the
predicted speedup is that priced tokens/s over the plain run's, rep by rep. The budgeted mode's own
expectation (``planned``: what its plans expected to buy, step by step) is reported too.
"""

from __future__ import annotations

import copy
import statistics
import time
from dataclasses import asdict, dataclass, field, replace

import torch
from tqdm import tqdm

from specdec_bench.common import MODELS_DIR, load_prompts, machine_facts
from specdec_core import Engine, SamplingParams
from specdec_core.calibration import calibrate
from specdec_core.cost_view import CostView
from specdec_core.stats import StepTiming

FIXED_KS = (1, 2, 4, 8)
MODES = ("plain", *(f"k{k}" for k in FIXED_KS), "auto", "budget")
BATCHES = (1, 2, 4, 8, 16, 32, 64)
# As a served replica calibrates (deployments/engine_hosts.py): the grid at context 64 and its context slopes from
# a second timing at half the served default context, so a step is priced at its rows' real context.
CALIBRATION = {"batches": BATCHES, "qs": (1, 2, 3, 5, 9), "long_context_len": 256}
K_MAX = 8  # auto's and the budget's cap
MIXED_NEW_TOKENS = 128  # the mixed cells' mean output length (``build_cells``); the prose sweep's is 32
WAVES = 4  # requests per batch slot in a cell's run (the steady window: all but the last)
# Output tokens a run has at least: at batch 1-2, four waves of 32-token outputs are 4-8 requests, which leaves a
# cell's measured speedups, and the acceptance the budget learns, to a handful of texts (prose b2 saw two).
MIN_RUN_TOKENS = 768


@dataclass(frozen=True)
class BudgetCell:
    name: str
    proposer: str  # "draft" (models/<family>/draft) or "ngram"
    batch: int
    rows: tuple[tuple[str, float], ...]  # (prompt set, temperature), cycled over the batch's rows
    max_new_tokens: int = 32


@dataclass
class BudgetResult:
    cell: str
    proposer: str
    batch: int
    rows: list
    max_new_tokens: int  # mean output length (requests run 1/2 to 3/2 of it)
    tok_s: dict  # mode -> median tokens/s over the steady window
    speedup: dict  # mode -> median of (mode / plain) rep by rep
    predicted: dict  # mode -> predicted speedup over plain (priced steps)
    budget_vs_best: float  # budget / the better of plain and the best fixed K (by median), median rep by rep
    best_fixed: str
    planned: float  # the budget's plans' own expected speedup, mean over its planned steps
    mean_k: dict = field(default_factory=dict)  # mode -> draft tokens per row-step
    tokens_per_verify_token: dict = field(default_factory=dict)  # mode -> (emitted - rows) / draft tokens
    acceptance: dict = field(default_factory=dict)  # mode -> accepted / proposed
    acceptance_by_rows: dict = field(default_factory=dict)  # mode -> prompt set -> (proposed, accepted / proposed)
    runs: int = 0


def build_cells(batches: tuple[int, ...]) -> list[BudgetCell]:
    prose = (("prose", 0.0),)
    cells = [BudgetCell(f"prose b{b}", "draft", b, prose) for b in batches]
    mixed = (("repetitive", 0.0), ("prose", 1.0))
    # The mixed cells' rows are what decoding does with them: their repetitive prompts are 90-128 tokens, and
    # on two cores a 128-token prefill costs ~60 ms, so behind 32-token outputs ~70% of the window was
    # prefill, the same in every mode (BENCHMARKS.md, "Where the planner's steps go"): outputs of 64-192.
    cells += [BudgetCell(f"mixed b{b}", "ngram", b, mixed, MIXED_NEW_TOKENS) for b in batches if 2 <= b <= 16]
    # Code at T=1 beside the repetitive rows: the n-gram proposer finds matches in code and proposes there, so a
    # fixed K verifies tokens that T=1 sampling rejects (prose gives it fewer matches).
    cells += [BudgetCell(f"mixed-code b{b}", "ngram", b, (("repetitive", 0.0), ("code", 1.0)), MIXED_NEW_TOKENS)
              for b in batches if 4 <= b <= 8]
    # The same rows over the distilled draft: it proposes on every row (the n-gram proposer proposes nothing
    # where it finds no match, so its fixed K already limits itself), so a fixed K pays its draft and verify
    # tokens on the T=1 prose rows too.
    cells += [BudgetCell(f"mixed-draft b{b}", "draft", b, mixed, MIXED_NEW_TOKENS) for b in batches if 2 <= b <= 16]
    return cells


class Engines:
    """One engine per proposer, calibrated once (greedy and sampling path)."""

    def __init__(self, models_dir, max_batch: int):
        self.models_dir, self.max_batch = models_dir, max_batch
        self._engines: dict[str, Engine] = {}

    def get(self, proposer: str) -> Engine:
        if proposer not in self._engines:
            target = str(self.models_dir / "target")
            kw = dict(max_batch_size=self.max_batch, max_model_len=1024)
            eng = (Engine.from_pretrained(target, proposer="ngram", **kw) if proposer == "ngram"
                   else Engine.from_pretrained(target, str(self.models_dir / proposer), **kw))
            eng.enable_adaptive(calibrate(eng, **CALIBRATION), sampled_costs=calibrate(eng, **CALIBRATION,
                                                                                       temperature=1.0))
            self._engines[proposer] = eng
        return self._engines[proposer]

    def costs(self) -> dict[str, dict]:
        """Per proposer, the step costs its engine planned with (greedy and sampling path): a cell's
        choices follow its calibration, which moves from run to run on a shared machine."""
        return {p: {"greedy": e.adaptive.view.costs.to_dict(), "sampled": e.adaptive.view.sampled_costs.to_dict()}
                for p, e in self._engines.items()}


def requests_per_run(cell: BudgetCell) -> int:
    return max(WAVES * cell.batch, -(-MIN_RUN_TOKENS // cell.max_new_tokens))


def cell_prompts(cell: BudgetCell, models_dir) -> list[tuple[str, float]]:
    """(prompt, temperature) of each request of a run: request i is of the row set ``cell.rows[i % len]``
    and takes that set's next prompt (distinct requests, as a server sees, until the set is used up)."""
    sets = {name: load_prompts(name, models_dir=models_dir) for name, _ in cell.rows}
    taken = {name: 0 for name in sets}
    out = []
    for i in range(requests_per_run(cell)):
        name, temperature = cell.rows[i % len(cell.rows)]
        prompts = sets[name]
        out.append((prompts[taken[name] % len(prompts)], temperature))
        taken[name] += 1
    return out


def _params(mode: str, temperature: float, max_new: int, seed: int, domain: str) -> SamplingParams:
    k = 0 if mode == "plain" else (int(mode[1:]) if mode.startswith("k") else K_MAX)
    return SamplingParams(max_new_tokens=max_new, temperature=temperature, seed=seed, ignore_eos=True,
                          num_speculative_tokens=k, adaptive_k=mode in ("auto", "budget"), domain=domain)


@dataclass
class Run:
    """One mode's run of a cell, measured over its steady window: from the start until the last queued
    request is admitted, the batch full all along (what a server under steady load sees; the drain
    after it, the slowest rows alone, would charge speculation a tail that steady traffic never has)."""

    seconds: float  # the steady window's wall time
    tokens: int  # tokens emitted in it (decode tokens and prefills' first tokens)
    steps: list[StepTiming]  # its steps
    outputs: list  # every request's output, the drain included

    @property
    def tok_s(self) -> float:
        return self.tokens / self.seconds


def output_len(cell: BudgetCell, i: int) -> int:
    """Request i's output length: 1/2 to 3/2 of the cell's, spread over the requests (the same in
    every mode), so that requests finish and are replaced at different steps in every mode, as in a
    server; equal lengths would keep plain decoding's batch in lockstep, its prefills batched."""
    return max(2, cell.max_new_tokens // 2 + (i * 7) % (cell.max_new_tokens + 1))


def run_mode(engine: Engine, cell: BudgetCell, rows: list[tuple[str, float]], mode: str, seed: int) -> Run:
    """``rows`` (one per request, ``cell_prompts``) through the engine, ``cell.batch`` of them in flight at
    any time (a finished request's place is taken at the next step, as in a server under steady load)."""
    engine.adaptive.budgeted = mode == "budget"
    total = len(rows)
    queue = list(enumerate(rows))
    outs, trace, in_flight, window = {}, [], 0, None
    t0 = time.perf_counter()
    while queue or engine.has_work():
        while queue and in_flight < cell.batch:
            i, (prompt, temperature) = queue.pop(0)
            domain = cell.rows[i % len(cell.rows)][0]
            engine.add_request(prompt, _params(mode, temperature, output_len(cell, i), seed + i, domain), f"r{i}")
            in_flight += 1
        if not queue and window is None:
            window = (time.perf_counter() - t0, len(trace))
        for out in engine.step(stream_text=False):
            if out.finished:
                outs[out.request_id] = out
                in_flight -= 1
        trace.append(engine.last_step)
    seconds, n = window
    steps = trace[:n]
    return Run(seconds, sum(s.emitted + s.prefill_rows for s in steps), steps, [outs[f"r{i}"] for i in range(total)])


def priced_seconds(view: CostView, sampled_share: float, run: Run) -> float:
    """The run's steady window as the cost model prices it: each decode step a ragged step at its batch,
    its rows' K and its context (on the cell's share of sampled rows), each prefill as measured (the same
    work in every mode)."""
    return sum(s.prefill_s + (view.model_at(sampled_share, s.context_len).ragged_step_time(s.batch, list(s.ks))
                              if s.batch else 0.0) for s in run.steps)


def _run_with(engine: Engine, tracker, cell: BudgetCell, rows: list[tuple[str, float]], mode: str, seed: int) -> Run:
    engine.adaptive.tracker = tracker
    return run_mode(engine, cell, rows, mode, seed)


def run_cell(engines: Engines, cell: BudgetCell, reps: int, models_dir) -> BudgetResult:
    engine = engines.get(cell.proposer)
    rows = cell_prompts(cell, models_dir)
    # Each mode learns acceptance from its own steps only, as a server running it would. Rates by draft
    # position depend on the K policy that judged them (a deep K's first position starts more often where a
    # run of agreement ended), so a class shared with the fixed-K runs priced the budget's deep positions with
    # k8's runs of full acceptance and k1's first positions (prose b2: mean K 6.3 against 3.6-4.0 alone).
    fresh = engine.adaptive.tracker
    trackers = {m: copy.deepcopy(fresh) for m in MODES}
    for mode in ("auto", "budget"):  # the adaptive modes' warm-up (and the shapes')
        _run_with(engine, trackers[mode], cell, rows, mode, seed=0)
    runs: dict[str, list[Run]] = {m: [] for m in MODES}
    for rep in range(reps):
        order = MODES if rep % 2 == 0 else tuple(reversed(MODES))
        for mode in order:
            runs[mode].append(_run_with(engine, trackers[mode], cell, rows, mode, seed=1000 * rep))
    engine.adaptive.tracker = fresh
    tok_s = {m: statistics.median(r.tok_s for r in runs[m]) for m in MODES}
    speedup = {m: statistics.median(r.tok_s / p.tok_s for p, r in zip(runs["plain"], runs[m])) for m in MODES}
    fixed = [f"k{k}" for k in FIXED_KS]
    best_fixed = max(fixed, key=lambda m: tok_s[m])
    # The better of plain and the best fixed K by median, then rep by rep against that mode (the max of
    # five noisy modes per rep would be biased high).
    best = best_fixed if tok_s[best_fixed] > tok_s["plain"] else "plain"
    per_rep = [b.tok_s / x.tok_s for b, x in zip(runs["budget"], runs[best])]
    sampled_share = sum(1 for _, t in cell.rows if t) / len(cell.rows)
    priced = {m: [r.tokens / priced_seconds(engine.adaptive.view, sampled_share, r) for r in runs[m]] for m in MODES}
    predicted = {m: statistics.median(x / p for p, x in zip(priced["plain"], priced[m])) for m in MODES}
    steps = {m: [s for r in runs[m] for s in r.steps if s.batch] for m in MODES}
    planned = [s.planned_speedup for s in steps["budget"] if s.planned_speedup]
    stats = {m: [o.stats for r in runs[m] for o in r.outputs] for m in MODES}
    row_sets = [cell.rows[i % len(cell.rows)][0] for r in runs["plain"] for i in range(len(r.outputs))]
    return BudgetResult(
        cell=cell.name, proposer=cell.proposer, batch=cell.batch, rows=[list(r) for r in cell.rows],
        max_new_tokens=cell.max_new_tokens,
        tok_s=tok_s, speedup=speedup, predicted=predicted, budget_vs_best=statistics.median(per_rep),
        best_fixed=best_fixed, planned=statistics.fmean(planned) if planned else 1.0,
        mean_k={m: sum(s.draft_tokens for s in steps[m]) / max(1, sum(s.batch for s in steps[m])) for m in MODES},
        tokens_per_verify_token={
            m: (sum(s.emitted - s.batch for s in steps[m]) / sum(s.draft_tokens for s in steps[m])
                if sum(s.draft_tokens for s in steps[m]) else 0.0) for m in MODES},
        acceptance={m: sum(s.accepted for s in stats[m]) / max(1, sum(s.proposed for s in stats[m])) for m in MODES},
        acceptance_by_rows={m: _acceptance_by_rows(stats[m], row_sets) for m in MODES},
        runs=reps,
    )


def _acceptance_by_rows(stats: list, row_sets: list[str]) -> dict:
    """Prompt set -> (draft tokens proposed, share accepted) over requests whose rows are of that set: where
    a mode spent its verify tokens, and what they bought."""
    out = {}
    for name in dict.fromkeys(row_sets):
        mine = [s for s, r in zip(stats, row_sets) if r == name]
        proposed = sum(s.proposed for s in mine)
        out[name] = (proposed, sum(s.accepted for s in mine) / proposed if proposed else 0.0)
    return out


def run_budget(args) -> dict:
    torch.set_num_threads(args.threads)
    models_dir = args.models or MODELS_DIR
    batches = tuple(args.batches) if args.batches else BATCHES
    cells = build_cells(batches)
    if args.max_new_tokens:
        cells = [replace(c, max_new_tokens=args.max_new_tokens) for c in cells]
    if args.only:
        cells = [c for c in cells if any(c.name.startswith(o) for o in args.only)]
    reps = args.reps or 3
    engines = Engines(models_dir, max_batch=max(c.batch for c in cells))
    results = []
    for cell in tqdm(cells, desc="budget cells", unit="cell"):
        r = run_cell(engines, cell, reps, models_dir)
        results.append(r)
        best = r.best_fixed if r.tok_s[r.best_fixed] > r.tok_s["plain"] else "plain"
        tqdm.write(f"{r.cell:10s} " + " ".join(f"{m} {r.tok_s[m]:6.1f}" for m in MODES)
                   + f"  budget/best {r.budget_vs_best:.2f} (best {best})  pred {r.predicted['budget']:.2f}"
                   + f" vs {r.speedup['budget']:.2f}  mean K {r.mean_k['budget']:.2f}")
    return {
        "machine": machine_facts(args.threads),
        "config": {"reps": reps, "models": str(models_dir), "batches": list(batches), "k_max": K_MAX},
        "costs": engines.costs(),
        "cells": [asdict(r) for r in results],
    }


def budget_markdown(data: dict) -> str:
    lines = [
        f"Budgeted verification, in process ({data['machine'].get('cpu', '')}, {data['config']['reps']} reps, "
        f"models {data['config']['models']}): tokens/s, median over reps; each cell's mean output length in "
        "tokens beside its name.",
        "",
        "| cell | " + " | ".join(MODES) + " | budget / best | budget predicted / measured | mean K (budget) "
        "| tokens per draft token |",
        "|---" * (len(MODES) + 5) + "|",
    ]
    for c in data["cells"]:
        lines.append(
            f"| {c['cell']} ({c['max_new_tokens']}) | " + " | ".join(f"{c['tok_s'][m]:.1f}" for m in MODES)
            + f" | {c['budget_vs_best']:.2f} | {c['predicted']['budget']:.2f} / {c['speedup']['budget']:.2f}"
            + f" | {c['mean_k']['budget']:.2f} | {c['tokens_per_verify_token']['budget']:.2f} |"
        )
    mixed = [c for c in data["cells"] if len(c.get("acceptance_by_rows", {}).get("budget", {})) > 1]
    if mixed:
        lines += ["", "Where the verify tokens went on mixed batches: draft tokens proposed (share accepted) per "
                  "row set, the budget against the best fixed K.", ""]
        for c in mixed:
            lines.append(f"- {c['cell']}: " + "; ".join(
                f"{m} " + ", ".join(f"{name} {n} ({rate:.2f})" for name, (n, rate) in by_rows.items())
                for m, by_rows in ((m, c["acceptance_by_rows"][m]) for m in ("budget", c["best_fixed"]))))
    worst = max((abs(c["predicted"][m] / c["speedup"][m] - 1), c["cell"], m) for c in data["cells"] for m in MODES)
    lines += ["", f"Largest prediction error: {worst[0]:.0%} ({worst[2]} in {worst[1]})."]
    return "\n".join(lines) + "\n"
