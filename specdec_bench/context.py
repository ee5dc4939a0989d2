"""`specdec-bench context`: context length as a regime axis, a batch x context grid in process.

Every row of a cell holds ``context`` tokens of real prose (windows of the long prompt set, one offset
per row) and decodes ``NEW_TOKENS`` greedy tokens; all rows start together and finish together, so a
cell's tokens/s is its decode phase alone (after the target's prefill; the draft's catch-up prefill of
the prompt is inside, a cost of speculating). Modes, interleaved rep by rep:

- plain;
- fixed K with the full-KV draft (``k2``, ``k4``): its per-step KV read grows with the context, as the
  target's does;
- fixed K with the bounded draft (``k2w``, ``k4w``): the same draft over attention sinks and a recent
  window (``KVWindow``, StreamingLLM; MagicDec's draft), a read that does not grow;
- auto over each draft (``auto``, ``autow``): adaptive K per request, priced at its context; each is
  judged against plain and the fixed K of its own draft (``auto_vs_best``).

Predicted, per cell and mode: the steps each run took (each decode step's rows and their K) priced
with that engine's calibration (context 64, plus the per-token context slopes timed at
``CALIBRATION_LONG_CONTEXT``) at the cell's context (``StepCosts.at_context``), over plain's.

Acceptance is reported per context, so a draft that collapses on long contexts (vllm#52258) shows it.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import asdict, dataclass

import torch
from tqdm import tqdm

from specdec_bench.common import MODELS_DIR, load_prompts, machine_facts
from specdec_core import DraftModelProposer, Engine, KVWindow, ModelRunner, SamplingParams
from specdec_core.calibration import calibrate
from specdec_core.costmodel import CostModel
from specdec_core.stats import StepTiming

BATCHES = (1, 8, 16)
CONTEXTS = (128, 512, 2000)
NEW_TOKENS = 48
MAX_MODEL_LEN = 2048  # the family's max_position_embeddings
WINDOW = KVWindow(sinks=4, window=252)  # the draft was trained on 256-token windows
FIXED = {"k2": (2, "full"), "k4": (4, "full"), "k2w": (2, "window"), "k4w": (4, "window")}
AUTO = {"auto": "full", "autow": "window"}
MODES = ("plain", "k2", "k4", "auto", "k2w", "k4w", "autow")
K_MAX = 8  # auto's cap
CALIBRATION = {"batches": BATCHES, "qs": (1, 2, 3, 5, 9)}
CALIBRATION_LONG_CONTEXT = 1024


@dataclass
class ContextResult:
    batch: int
    context: int
    tok_s: dict  # mode -> median decode tokens/s over reps
    speedup: dict  # mode -> median of (mode / plain) rep by rep
    predicted: dict  # mode -> predicted speedup over plain
    acceptance: dict  # mode -> accepted / proposed
    mean_k: dict  # auto modes: draft tokens per row-step
    auto_vs_best: dict  # auto mode -> it over the best of plain and its draft's fixed K (by median), rep by rep
    best: dict  # auto mode -> that best mode
    catch_up_s: dict  # mode -> the draft's prefill of the rows' prompts (seconds, median), outside tok_s


class Engines:
    """One target, two drafts over it (full KV and bounded), each engine calibrated once."""

    def __init__(self, models_dir, max_batch: int):
        target = str(models_dir / "target")
        draft = str(models_dir / "draft")
        self.full = Engine.from_pretrained(target, draft, max_batch_size=max_batch, max_model_len=MAX_MODEL_LEN)
        bounded = ModelRunner.from_pretrained(draft, max_slots=max_batch, max_len=MAX_MODEL_LEN, kv_window=WINDOW,
                                              device=self.full.target.device, dtype=self.full.target.dtype)
        self.window = self.full.sibling(DraftModelProposer(bounded, name=f"{draft} (window)"))
        self.costs = {}
        for name, eng in (("full", self.full), ("window", self.window)):
            self.costs[name] = calibrate(eng, **CALIBRATION, long_context_len=CALIBRATION_LONG_CONTEXT)
        self.full.enable_adaptive(self.costs["full"])
        self.window.enable_adaptive(self.costs["window"])

    @staticmethod
    def draft_of(mode: str) -> str:
        return AUTO.get(mode) or (FIXED[mode][1] if mode in FIXED else "full")

    def for_mode(self, mode: str) -> Engine:
        return self.full if self.draft_of(mode) == "full" else self.window


def row_prompts(stream: list[int], batch: int, context: int) -> list[list[int]]:
    """``batch`` windows of ``context`` tokens of the stream, at offsets spread over it."""
    span = len(stream) - context
    return [stream[(i * 2039) % span:][:context] for i in range(batch)]


def long_stream(engine: Engine, models_dir) -> list[int]:
    ids: list[int] = []
    for prompt in load_prompts("long", models_dir=models_dir):
        ids += engine.encode(prompt)
    return ids


@dataclass
class Run:
    tok_s: float  # decode tokens/s after the first decode step
    tokens: int
    steps: list[StepTiming]
    catch_up_s: float  # the first decode step's propose phase: the draft's prefill of the prompt
    accepted: int
    proposed: int


def run_mode(engine: Engine, prompts: list[list[int]], mode: str) -> Run:
    k = K_MAX if mode in AUTO else FIXED[mode][0] if mode in FIXED else 0
    params = SamplingParams(max_new_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True, num_speculative_tokens=k,
                            adaptive_k=mode in AUTO, domain="prose")
    ids = [engine.add_request(p, params) for p in prompts]
    outs = {}
    engine.step(stream_text=False)  # the target's prefill of every row
    engine.step(stream_text=False)  # the first decode step: the draft's prefill of every row (catch-up)
    catch_up_s = engine.last_step.propose_s
    t0, tokens, steps = time.perf_counter(), 0, []
    while engine.has_work():
        for out in engine.step(stream_text=False):
            if out.finished:
                outs[out.request_id] = out
        steps.append(engine.last_step)
        tokens += engine.last_step.emitted
    seconds = time.perf_counter() - t0
    stats = [outs[i].stats for i in ids]
    return Run(tokens / seconds, tokens, steps, catch_up_s, sum(s.accepted for s in stats),
               sum(s.proposed for s in stats))


def priced_tok_s(costs, context: int, run: Run) -> float:
    """The run's decode steps as the calibration prices them at the cell's context (each a ragged step at
    its batch and its rows' K; the context grows by at most NEW_TOKENS over a run: priced at its start)."""
    model = CostModel(costs.at_context(context))
    return run.tokens / sum(model.ragged_step_time(s.batch, list(s.ks)) for s in run.steps)


def run_cell(engines: Engines, stream: list[int], batch: int, context: int, reps: int) -> ContextResult:
    prompts = row_prompts(stream, batch, context)
    runs: dict[str, list[Run]] = {m: [] for m in MODES}
    run_mode(engines.full, prompts[:1], "k4")  # warm the shapes
    for rep in range(reps):
        for mode in MODES if rep % 2 == 0 else tuple(reversed(MODES)):
            runs[mode].append(run_mode(engines.for_mode(mode), prompts, mode))
    tok_s = {m: statistics.median(r.tok_s for r in runs[m]) for m in MODES}
    speedup = {m: statistics.median(r.tok_s / p.tok_s for p, r in zip(runs["plain"], runs[m])) for m in MODES}
    acceptance = {m: sum(r.accepted for r in runs[m]) / max(1, sum(r.proposed for r in runs[m])) for m in MODES}
    priced = {m: [priced_tok_s(engines.costs[engines.draft_of(m)], context, r) for r in runs[m]] for m in MODES}
    predicted = {m: statistics.median(x / p for p, x in zip(priced["plain"], priced[m])) for m in MODES}
    mean_k, auto_vs_best, best = {}, {}, {}
    for auto, draft in AUTO.items():
        steps = [s for r in runs[auto] for s in r.steps]
        mean_k[auto] = sum(s.draft_tokens for s in steps) / max(1, sum(s.batch for s in steps))
        rivals = ["plain"] + [m for m, (_, d) in FIXED.items() if d == draft]
        best[auto] = max(rivals, key=lambda m: tok_s[m])
        auto_vs_best[auto] = statistics.median(a.tok_s / b.tok_s for a, b in zip(runs[auto], runs[best[auto]]))
    return ContextResult(batch, context, tok_s, speedup, predicted, acceptance, mean_k, auto_vs_best, best,
                         {m: statistics.median(r.catch_up_s for r in runs[m]) for m in MODES})


def run_context(args) -> dict:
    torch.set_num_threads(args.threads)
    models_dir = args.models or MODELS_DIR
    batches = tuple(args.batches) if args.batches else BATCHES
    contexts = tuple(args.contexts) if args.contexts else CONTEXTS
    reps = args.reps or 2
    engines = Engines(models_dir, max_batch=max(batches))
    stream = long_stream(engines.full, models_dir)
    results = []
    for batch in batches:
        for context in tqdm(contexts, desc=f"batch {batch}", unit="context"):
            r = run_cell(engines, stream, batch, context, reps)
            results.append(r)
            tqdm.write(f"b{batch:<3d} ctx{context:<5d} " + " ".join(f"{m} {r.tok_s[m]:6.1f}" for m in MODES)
                       + "  " + " ".join(f"{a}/best {r.auto_vs_best[a]:.2f} ({r.best[a]})" for a in AUTO)
                       + f"  acc full {r.acceptance['k4']:.2f} window {r.acceptance['k4w']:.2f}")
    return {
        "machine": machine_facts(args.threads),
        "config": {"reps": reps, "models": str(models_dir), "batches": list(batches), "contexts": list(contexts),
                   "new_tokens": NEW_TOKENS, "window": asdict(WINDOW), "k_max": K_MAX},
        "costs": {name: c.to_dict() for name, c in engines.costs.items()},
        "cells": [asdict(r) for r in results],
    }


def context_markdown(data: dict) -> str:
    w = data["config"]["window"]
    lines = [
        f"Context as a regime axis, in process ({data['machine'].get('cpu', '')}, {data['config']['reps']} reps, "
        f"models {data['config']['models']}, {data['config']['new_tokens']} greedy tokens of prose per row; "
        f"bounded draft: {w['sinks']} sinks + a {w['window']}-token window). Decode tokens/s, median over reps; "
        "x = of plain, measured (predicted).",
        "",
        "| batch | context | plain | " + " | ".join(MODES[1:]) + " | auto / best | autow / best "
        "| acceptance full / window |",
        "|---" * (len(MODES) + 5) + "|",
    ]
    for c in data["cells"]:
        cells = [f"{c['tok_s'][m]:.1f} ({c['speedup'][m]:.2f}x, {c['predicted'][m]:.2f})" for m in MODES[1:]]
        lines.append(
            f"| {c['batch']} | {c['context']} | {c['tok_s']['plain']:.1f} | " + " | ".join(cells)
            + "".join(f" | {c['auto_vs_best'][a]:.2f} ({c['best'][a]})" for a in AUTO)
            + f" | {c['acceptance']['k4']:.2f} / {c['acceptance']['k4w']:.2f} |"
        )
    errors = [(abs(c["predicted"][m] / c["speedup"][m] - 1), f"{m} at b{c['batch']} ctx{c['context']}")
              for c in data["cells"] for m in MODES[1:]]
    worst = max(errors)
    lines += ["", f"Largest prediction error: {worst[0]:.0%} ({worst[1]})."]
    return "\n".join(lines) + "\n"
