"""`specdec-bench predict`: the roofline cost model's answers for hardware and model pairs we do not
have (`specdec_core.roofline`).

- one configuration (`--target-config ... --json`): fixed-K and best-K speedup, step times, the
  drafting share of a speculative step;
- the regime map: best-K and fixed-K speedup over (batch x acceptance) and the drafting share, per
  device and pair;
- `--published`: the model against published draft-model measurements, two sources:
  SpecDecode-Bench (reference/specdecode_bench.json, what the engine costs were fitted to), the
  acceptance of each curve implied by its batch-1 point; and a vLLM V1 serving sweep (Ruiz 2026,
  reference/ruiz_vllm_v1_draft_model.json), predicted unchanged from each run's published acceptance
  length, nothing fitted.

Vocabulary: a is the per-token acceptance rate, tau = E_K(a) the mean tokens a target pass emits
(accepted drafts plus the recovered or bonus token).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path

from specdec_core.costmodel import CostModel, expected_tokens_per_step
from specdec_core.roofline import (
    DEVICES,
    H100,
    H200,
    VLLM,
    DeviceSpec,
    ModelShape,
    forward_time,
    prefill_time,
    roofline_costs,
)
from specdec_core.step_costs import StepCosts

REFERENCE = Path(__file__).parent / "reference"
CONFIGS = REFERENCE / "configs"
PUBLISHED = REFERENCE / "specdecode_bench.json"
PUBLISHED_SERVING = REFERENCE / "ruiz_vllm_v1_draft_model.json"
SERVING_COLUMNS = ("concurrency", "requests", "input_tokens", "output_tokens", "plain_tok_s", "spec_tok_s",
                   "acceptance_length")

BATCHES = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)
ACCEPTANCES = (0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9)
K_MAX = 8
MAP_K = 3  # the regime map's fixed K when --k is not given: SpecDecode-Bench's (and vLLM examples')
PAIRS = {  # label: (target config, draft config, tensor parallel degree)
    "Llama-3-8B + Llama-3.2-1B": ("llama-3-8b.json", "llama-3.2-1b.json", 1),
    "Llama-3-70B TP4 + Llama-3.2-1B": ("llama-3-70b.json", "llama-3.2-1b.json", 4),
    "Qwen3-8B + Qwen3-0.6B": ("qwen3-8b.json", "qwen3-0.6b.json", 1),
}


def load_shape(path: str | Path) -> ModelShape:
    """A HF config.json; a bare name is looked up among the shipped configs."""
    path = Path(path)
    return ModelShape.from_hf_config(json.loads((path if path.exists() else CONFIGS / path).read_text()))


def acceptance_for_tau(tau: float, k: int) -> float:
    """The a with E_K(a) = tau (E_K rises with a from 1 to K+1)."""
    if not 1.0 <= tau <= k + 1:
        raise ValueError(f"tau must be in [1, K+1] = [1, {k + 1}], got {tau}")
    lo, hi = 0.0, 1.0
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if expected_tokens_per_step(mid, k) < tau else (lo, mid)
    return (lo + hi) / 2


# ---- one configuration ----


def predict_one(args) -> dict:
    """One (pair, device, tp, dtype, batch, K, acceptance, context) point; the JSON of `--json`."""
    if args.k < 1:
        raise ValueError("--k must be >= 1")
    a = args.acceptance if args.acceptance is not None else acceptance_for_tau(args.tau, args.k)
    costs = roofline_costs(load_shape(args.target_config), load_shape(args.draft_config), DEVICES[args.device],
                           batches=(args.batch,), qs=(1, args.k + 1), context_len=args.context, tp=args.tp,
                           dtype=args.dtype)
    return {"device": args.device, "tp": args.tp, "dtype": args.dtype, "batch": args.batch, "k": args.k,
            "context_len": args.context, "acceptance": a, "tau": expected_tokens_per_step(a, args.k),
            **_step_answer(CostModel(costs), args.batch, args.k, a)}


def _step_answer(model: CostModel, batch: int, k: int, a: float) -> dict:
    best = model.best_k(batch, a, K_MAX)
    return {
        "fixed_k_speedup": _fixed_k_speedup(model, batch, k, a),
        "best_k": best.k,
        "best_k_speedup": best.predicted_speedup,
        "cost_ratio": model.cost_ratio(batch),
        "plain_step_s": model.plain_time_per_token(batch),
        "spec_step_s": model.spec_step_time(batch, k),
        "draft_s": k * model.costs.draft_time(batch),
        "draft_share": _draft_share(model, batch, k),
    }


def _fixed_k_speedup(model: CostModel, batch: int, k: int, a: float) -> float:
    """Below 1 where a deployment fixed at K is slower than plain decoding (best K floors at 1)."""
    return model.plain_time_per_token(batch) / model.spec_time_per_token(batch, k, a)


def _draft_share(model: CostModel, batch: int, k: int) -> float:
    """Drafting's share of one speculative step (K draft passes over the whole step)."""
    return k * model.costs.draft_time(batch) / model.spec_step_time(batch, k)


def one_markdown(d: dict) -> str:
    return "\n".join([
        (f"# Predicted step: {d['device']} tp={d['tp']} {d['dtype']}, batch {d['batch']}, K={d['k']}, "
         f"a={d['acceptance']:.3f} (tau {d['tau']:.2f}), context {d['context_len']}"), "",
        "| fixed-K speedup | best K | best-K speedup | cost ratio | plain step ms | spec step ms | drafting share |",
        "|---|---|---|---|---|---|---|",
        (f"| {d['fixed_k_speedup']:.3f} | {d['best_k']} | {d['best_k_speedup']:.3f} | {d['cost_ratio']:.3f} | "
         f"{1e3 * d['plain_step_s']:.2f} | {1e3 * d['spec_step_s']:.2f} | {d['draft_share']:.1%} |"), ""])


# ---- the regime map ----


def run_predict(args) -> dict:
    k = args.k or MAP_K
    scenarios = []
    for device in (H100, H200):
        for pair, (target, draft, tp) in PAIRS.items():
            costs = roofline_costs(load_shape(target), load_shape(draft), device, BATCHES, range(1, K_MAX + 2),
                                   context_len=args.context, tp=tp)
            scenarios.append({"name": f"{device.name} {pair}", "device": device.name, "pair": pair, "tp": tp,
                              **_regime_map(CostModel(costs), k), "topologies": _topologies(costs),
                              "by_context": _context_axis(load_shape(target), load_shape(draft), device, tp)})
    return {"batches": list(BATCHES), "acceptances": list(ACCEPTANCES), "context_len": args.context, "k": k,
            "scenarios": scenarios}


def _regime_map(model: CostModel, k: int) -> dict:
    grid, ks, fixed, break_even = [], [], [], {}
    for a in ACCEPTANCES:
        choices = [model.best_k(b, a, k_max=K_MAX) for b in BATCHES]
        grid.append([round(c.predicted_speedup, 3) for c in choices])
        ks.append([c.k for c in choices])
        fixed.append([round(_fixed_k_speedup(model, b, k, a), 3) for b in BATCHES])
        break_even[str(a)] = next((b for b, c in zip(BATCHES, choices) if c.k == 0), None)
    return {"speedup": grid, "best_k": ks, "fixed_k_speedup": fixed,
            "draft_share": [round(_draft_share(model, b, k), 3) for b in BATCHES],
            "break_even_batch": break_even, "cost_ratio_b1": model.cost_ratio(1)}


AXIS_CONTEXTS = (512, 2048, 8192, 32768)
AXIS_ACCEPTANCES = (0.6, 0.8)
DRAFT_WINDOW = 256  # a bounded draft's positions (sinks + window; MagicDec's StreamingLLM draft)


def _context_axis(target: ModelShape, draft: ModelShape, device, tp: int) -> list[dict]:
    """The break-even batch (the first where plain wins; None: never up to the largest) along the
    context, with the full-KV draft and with a bounded one: at long contexts a step is the KV read
    again and a verify nearly free at any batch (MagicDec), unless the draft's own read grows too."""
    rows = []
    for context in AXIS_CONTEXTS:
        row = {"context": context}
        for name, window in (("full", None), ("window", DRAFT_WINDOW)):
            model = CostModel(roofline_costs(target, draft, device, BATCHES, range(1, K_MAX + 2), context_len=context,
                                             tp=tp, draft_window=window))
            for a in AXIS_ACCEPTANCES:
                choices = [model.best_k(b, a, k_max=K_MAX) for b in BATCHES]
                row[f"{name} a={a}"] = next((b for b, c in zip(BATCHES, choices) if c.k == 0), None)
        rows.append(row)
    return rows


TOPOLOGY_BATCHES = (1, 8, 32)
TOPOLOGY_ACCEPTANCES = (0.6, 0.8, 0.9)


def _topologies(costs: StepCosts) -> list[dict]:
    """Best-K speedup over plain per topology: co-located, separate without overlap (its per-step
    orchestration overhead, ``SEPARATE_HOP_S`` as measured here, added to every step) and separate
    with the draft's next round overlapped with the verify where that pays (then a^K of the
    overlapped proposals are kept)."""
    overlapped, sequential = CostModel(costs), CostModel(replace(costs, overlapped=()))
    rows = []
    for b in TOPOLOGY_BATCHES:
        for a in TOPOLOGY_ACCEPTANCES:
            col = overlapped.best_k(b, a, K_MAX, "colocated")
            seq = sequential.best_k(b, a, K_MAX, "separate")
            ovl = overlapped.best_k(b, a, K_MAX, "separate")
            rows.append({"batch": b, "acceptance": a, "colocated": round(col.predicted_speedup, 3),
                         "colocated_k": col.k, "separate": round(seq.predicted_speedup, 3), "separate_k": seq.k,
                         "separate_overlapped": round(ovl.predicted_speedup, 3), "overlapped_k": ovl.k,
                         "overlap_pays": bool(ovl.k) and overlapped.overlap_pays(b, ovl.k, a)})
    return rows


def predict_markdown(data: dict) -> str:
    batches, k = data["batches"], data["k"]
    head = ["| a \\ batch | " + " | ".join(str(b) for b in batches) + " |", "|---" * (len(batches) + 1) + "|"]
    lines = ["# Predicted regime map (roofline cost model)", "",
             (f"Context length {data['context_len']}. Best K in 1..{K_MAX} or plain (never below 1.00), and a "
              f"fixed K={k} (below 1.00: speculation at that K is slower than plain); speedup = plain / "
              "speculative time per token."), ""]
    for s in data["scenarios"]:
        lines += [f"## {s['name']} (cost ratio at batch 1: {s['cost_ratio_b1']:.3f})", "", "Best K:", "", *head]
        lines += [f"| {a} | " + " | ".join(f"{v:.2f} (K={kk})" for v, kk in zip(row, ks)) + " |"
                  for a, row, ks in zip(data["acceptances"], s["speedup"], s["best_k"])]
        lines += ["", f"Fixed K={k}:", "", *head]
        lines += [f"| {a} | " + " | ".join(f"**{v:.2f}**" if v < 1 else f"{v:.2f}" for v in row) + " |"
                  for a, row in zip(data["acceptances"], s["fixed_k_speedup"])]
        lines += ["", f"Drafting share of a K={k} step: "
                  + ", ".join(f"b={b}: {v:.0%}" for b, v in zip(batches, s["draft_share"])),
                  "", "Break-even batch (first batch where plain wins): "
                  + ", ".join(f"a={a}: {b}" for a, b in s["break_even_batch"].items()), ""]
        lines += [("Topologies (best K; separate: + the measured per-step orchestration overhead; overlapped: the "
                   "draft's next round during the verify where that pays; rounds kept: a^K of those overlapped):"), "",
                  "| batch | a | co-located | separate | separate, overlapped | rounds kept |",
                  "|---|---|---|---|---|---|"]
        lines += [f"| {r['batch']} | {r['acceptance']} | {r['colocated']:.2f} (K={r['colocated_k']}) | "
                  f"{r['separate']:.2f} (K={r['separate_k']}) | {r['separate_overlapped']:.2f} (K={r['overlapped_k']}"
                  f"{', overlap' if r['overlap_pays'] else ''}) | "
                  f"{r['acceptance'] ** r['overlapped_k'] if r['overlap_pays'] else 0:.0%} |" for r in s["topologies"]]
        columns = [c for c in s["by_context"][0] if c != "context"]
        lines += ["", (f"Break-even batch by context (first batch where plain wins; - : none up to {batches[-1]}; "
                       f"window: a draft bounded to {DRAFT_WINDOW} positions):"), "",
                  "| context | " + " | ".join(columns) + " |", "|---" * (len(columns) + 1) + "|"]
        lines += [f"| {r['context']} | " + " | ".join("-" if r[c] is None else str(r[c]) for c in columns) + " |"
                  for r in s["by_context"]]
        lines += [""]
    return "\n".join(lines) + "\n"


# ---- the model against published measurements ----


@dataclass(frozen=True)
class PublishedRun:
    """One published draft-model workload: rows that each prefill `prompt_len` tokens, then decode
    `output_len` tokens in as many plain steps or output_len / tau speculative steps, the draft's
    prefill included. SpecDecode-Bench runs one batch of identical prompts (`times`); a serving
    benchmark keeps a number of requests in flight (`serving_speedup`)."""

    target: ModelShape
    draft: ModelShape
    tp: int
    k: int
    prompt_len: int
    output_len: int
    device: DeviceSpec = H100

    @property
    def context_len(self) -> int:
        """Mean cached tokens per row over the decode."""
        return self.prompt_len + self.output_len // 2

    def times(self, batch: int, tau: float) -> tuple[float, float, float]:
        """(plain run, speculative run, drafting within it), seconds."""
        costs = roofline_costs(self.target, self.draft, self.device, batches=(batch,), qs=(1, self.k + 1),
                               context_len=self.context_len, tp=self.tp)
        model = CostModel(costs)
        prefill_target, prefill_draft = (prefill_time(m, self.device, batch, self.prompt_len, self.tp)
                                         for m in (self.target, self.draft))
        steps = self.output_len / tau
        plain = prefill_target + self.output_len * model.plain_time_per_token(batch)
        spec = prefill_target + prefill_draft + steps * model.spec_step_time(batch, self.k)
        return plain, spec, prefill_draft + steps * self.k * costs.draft_time(batch)

    def implied_tau(self, speedup_b1: float) -> float:
        """The tau at which the predicted batch-1 speedup equals the published one (speedup is
        plain / spec, spec linear in 1 / tau)."""
        plain, spec_at_1, _ = self.times(1, 1.0)
        spec_at_inf = self.times(1, float("inf"))[1]
        return (spec_at_1 - spec_at_inf) / (plain / speedup_b1 - spec_at_inf)

    def speedup(self, batch: int, tau: float) -> float:
        plain, spec, _ = self.times(batch, tau)
        return plain / spec

    def serving_speedup(self, requests: int, concurrency: int, tau: float) -> float:
        """`requests` through a server that keeps `concurrency` of them in flight (`vllm bench serve
        --max-concurrency`), as successive waves of `concurrency` rows, the last one partial: the
        requests are alike in length, so they start and finish nearly together."""
        full, rest = divmod(requests, concurrency)
        waves = [concurrency] * full + [rest] * (rest > 0)
        times = [self.times(rows, tau) for rows in waves]
        return sum(t[0] for t in times) / sum(t[1] for t in times)

    def forward_ratio(self) -> float:
        """One draft pass (the proposer's per-pass work included) over the verify forward it feeds,
        batch 1."""
        draft = forward_time(self.draft, self.device, 1, 1, self.context_len, self.tp) + VLLM.draft_pass_s
        return draft / forward_time(self.target, self.device, self.k + 1, 1, self.context_len, self.tp)


def compare_published(path: Path = PUBLISHED) -> dict:
    """Every published point beside its prediction; errors in percent of the published value."""
    pub = json.loads(path.read_text())
    rows, share_rows, ratios = [], [], []
    for pair_id, pair in pub["pairs"].items():
        runs = {ds: PublishedRun(load_shape(pair["target"]), load_shape(pair["draft"]), pair["tp"], pub["setup"]["k"],
                                 lengths["prompt_len"], lengths["output_len"])
                for ds, lengths in pub["datasets"].items() if ds != "source"}
        curves = pub["speedups"][pair_id]
        for ds, points in curves.items():
            rows += _speedup_rows(runs[ds], pub["speedups"]["batches"], points,
                                  {"pair": pair["label"], "dataset": pub["datasets"][ds]["label"]})
        shares = pub["time_shares"]
        run = runs[shares["dataset"]]
        tau = run.implied_tau(curves[shares["dataset"]][0])
        for b, published in zip(shares["batches"], shares[pair_id]["drafting"]):
            _, spec, drafting = run.times(b, tau)
            share_rows.append({"pair": pair["label"], "batch": b, "published_pct": published,
                               "predicted_pct": 100 * drafting / spec})
        ratios.append({"pair": pair["label"], "published": pub["forward_ratios"][pair_id],
                       "predicted": run.forward_ratio()})
    return {"paper": pub["paper"], "k": pub["setup"]["k"], "speedups": rows, "drafting_shares": share_rows,
            "forward_ratios": ratios, "max_abs_error_pct": max(abs(r["error_pct"]) for r in rows)}


def _speedup_rows(run: PublishedRun, batches: list[int], published: list[float], label: dict) -> list[dict]:
    """One curve: tau from its batch-1 point, then every batch predicted with it."""
    tau = run.implied_tau(published[0])
    return [{**label, "batch": b, "tau": tau, "published": p, "predicted": run.speedup(b, tau),
             "error_pct": _error_pct(run.speedup(b, tau), p)} for b, p in zip(batches, published)]


def _error_pct(predicted: float, published: float) -> float:
    return 100 * (predicted / published - 1)


def published_markdown(data: dict) -> str:
    lines = [f"# Roofline model vs SpecDecode-Bench (draft model, H100, vLLM, K={data['k']})", "", data["paper"], "",
             "Speedups (Figure 1); tau implied by each curve's batch-1 point:", "",
             "| pair | dataset | tau | batch | published | predicted | error |", "|---|---|---|---|---|---|---|"]
    lines += [f"| {r['pair']} | {r['dataset']} | {r['tau']:.2f} | {r['batch']} | {r['published']:.2f} | "
              f"{r['predicted']:.2f} | {r['error_pct']:+.1f}% |" for r in data["speedups"]]
    lines += ["", f"Largest error: {data['max_abs_error_pct']:.1f}%", "",
              "Drafting share of the run (Figure 4, CNN/DailyMail, prefill included):", "",
              "| pair | batch | published | predicted |", "|---|---|---|---|"]
    lines += [f"| {r['pair']} | {r['batch']} | {r['published_pct']:.1f}% | {r['predicted_pct']:.1f}% |"
              for r in data["drafting_shares"]]
    lines += ["", "Draft pass / verify forward at batch 1:", "", "| pair | published | predicted |", "|---|---|---|"]
    lines += [f"| {r['pair']} | {r['published']:.3f} | {r['predicted']:.3f} |" for r in data["forward_ratios"]]
    return "\n".join(lines) + "\n"


def compare_serving(path: Path = PUBLISHED_SERVING) -> dict:
    """A published `vllm bench serve` sweep beside its predictions. Speedup is output throughput with
    over without speculation at the same concurrency; tau is each run's published acceptance length,
    so nothing is fitted. A point is kv_limited where `concurrency` whole requests overflow the smaller
    of the two servers' KV caches: requests then wait and the batch is below the concurrency, which
    the model does not know; the largest error leaves those points out."""
    pub = json.loads(path.read_text())
    device = DEVICES[pub["setup"]["device"]]
    rows = [row for series in pub["series"]
            for row in _serving_rows(pub["pairs"][series["pair"]], series, device)]
    return {"source": pub["source"], "rows": rows,
            "max_abs_error_pct": max(abs(r["error_pct"]) for r in rows if not r["kv_limited"])}


def _serving_rows(pair: dict, series: dict, device: DeviceSpec) -> list[dict]:
    """One series: a pair, a dataset and K over concurrencies, each point with its own mean lengths."""
    target, draft = load_shape(pair["target"]), load_shape(pair["draft"])
    kv_tokens = min(pair["kv_cache_tokens"].values())
    rows = []
    for c, n, prompt, output, plain, spec, tau in zip(*(series[col] for col in SERVING_COLUMNS)):
        run = PublishedRun(target, draft, pair["tp"], series["k"], round(prompt / n), round(output / n),
                           device)
        predicted, published = run.serving_speedup(n, c, tau), spec / plain
        rows.append({"pair": pair["label"], "dataset": series["dataset"], "k": series["k"], "concurrency": c,
                     "tau": tau, "published": published, "predicted": predicted,
                     "error_pct": _error_pct(predicted, published),
                     "kv_limited": c * (prompt + output) / n > kv_tokens})
    return rows


def serving_markdown(data: dict) -> str:
    lines = ["# Roofline model, unchanged, vs a vLLM V1 serving sweep (draft model, H100)", "",
             data["source"], "",
             ("Speedup: output throughput with / without speculation at the same concurrency; tau: the "
              "run's published acceptance length (nothing fitted). * the concurrency's requests overflow "
              "the KV cache (requests wait, the batch is smaller): outside the model."), "",
             "| pair | dataset | K | concurrency | tau | published | predicted | error |",
             "|---|---|---|---|---|---|---|---|"]
    lines += [f"| {r['pair']} | {r['dataset']} | {r['k']} | {r['concurrency']}{'*' * r['kv_limited']} | "
              f"{r['tau']:.2f} | {r['published']:.2f} | {r['predicted']:.2f} | {r['error_pct']:+.1f}% |"
              for r in data["rows"]]
    lines += ["", f"Largest error where the requests fit the KV cache: {data['max_abs_error_pct']:.1f}%"]
    return "\n".join(lines) + "\n"


def run_published() -> dict:
    """`--published`: both sources against the same model."""
    return {"specdecode_bench": compare_published(), "serving_sweep": compare_serving()}


def run_published_markdown(data: dict) -> str:
    return published_markdown(data["specdecode_bench"]) + "\n" + serving_markdown(data["serving_sweep"])
