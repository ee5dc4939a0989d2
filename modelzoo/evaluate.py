"""Evaluate the model family and write the model card.

    python -m modelzoo.evaluate --models models --out models/README.md

Measures, per model: parameters, shape, training tokens/time (from training.json);
held-out loss (nats/token) per domain beside an interpolated bigram baseline computed
here from the training split; greedy samples from the target; the acceptance matrix
(each draft x each domain: teacher-forced greedy agreement and the exact expected
acceptance at temperature 1, E[sum_v min(p_target, p_draft)]); and each draft's cost
ratio at batch 1 (from the physics below). Goals that are missed are reported as missed, with the number.
Also the physics, through the serving engine's own forward (``specdec_core.ModelRunner``, 1 thread
as a served replica runs): bytes of weights, ms per 1-token step and per 5-token verify at batch 1,
8 and 32, the verify/step ratio, and the ridge (the most tokens one batch-1 forward takes for at
most 1.25x the 1-token step: below it a verify is nearly free, as on a GPU at low batch).
Also writes <out dir>/eval.json with every number.

    python -m modelzoo.evaluate --models models/dram --out models/dram/README.md   # the served family
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import time
from pathlib import Path

import numpy as np

from modelzoo.bigram import Bigram
from modelzoo.corpus import LICENSES, read_jsonl

DOMAINS = ("prose", "code", "docs")
GOAL_DOMAINS = ("prose", "code")
TOKENS = Path("data/tokens")
CORPUS = Path("data/corpus")


def load_tokens(domain, split):
    return np.load(TOKENS / f"{domain}_{split}.npy")


def windows(domain: str, seq_len: int, n_seq: int):
    """n_seq evenly spaced windows of seq_len+1 held-out tokens (fixed)."""
    import torch
    arr = load_tokens(domain, "heldout")
    starts = np.linspace(0, len(arr) - seq_len - 2, n_seq).astype(np.int64)
    return torch.from_numpy(np.stack([arr[s:s + seq_len + 1].astype(np.int64) for s in starts]))


def load(path):
    import torch
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()


def logits_of(model, x, bs=8):
    import torch
    with torch.no_grad():
        return torch.cat([model(input_ids=x[i:i + bs]).logits for i in range(0, len(x), bs)])


def heldout_nll(logits, y) -> float:
    import torch.nn.functional as F
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), y.reshape(-1)).item()


def acceptance(t_logits, d_logits) -> tuple[float, float]:
    """(greedy agreement, expected acceptance at T=1) averaged over all positions."""
    import torch
    agree = (t_logits.argmax(-1) == d_logits.argmax(-1)).float().mean().item()
    pt, pd = torch.softmax(t_logits, -1), torch.softmax(d_logits, -1)
    acc = torch.minimum(pt, pd).sum(-1).mean().item()
    return agree, acc


PHYSICS_BATCHES = (1, 8, 32)
RIDGE_WIDTHS = (1, 2, 3, 4, 5, 6, 8, 12, 16, 24, 32, 48, 64)
FREE_VERIFY = 1.25  # a forward within this factor of the 1-token step counts as (nearly) free


def physics(path: Path, repeats: int = 5, trials: int = 3) -> dict:
    """Step and verify times through the engine's forward (the min of ``trials`` medians: the
    machine is shared, and load only ever adds time)."""
    import torch

    from specdec_core.runner import ModelRunner

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        runner = ModelRunner.from_pretrained(str(path), device="cpu", max_slots=max(PHYSICS_BATCHES), max_len=512)

        def ms(b: int, q: int) -> float:
            return 1e3 * min(runner.time_step(b, q, repeats=repeats) for _ in range(trials))

        out = {"weight_bytes": sum(p.numel() * p.element_size() for p in runner.model.parameters()), "batches": {}}
        for b in PHYSICS_BATCHES:
            step, verify = ms(b, 1), ms(b, 5)
            out["batches"][b] = {"step_ms": step, "verify5_ms": verify, "ratio": verify / step}
        step1 = out["batches"][1]["step_ms"]
        widths = {q: ms(1, q) for q in RIDGE_WIDTHS}
        out["batch1_ms_by_width"] = widths
        out["ridge_tokens"] = max(q for q, t in widths.items() if t <= FREE_VERIFY * step1)
        return out
    finally:
        torch.set_num_threads(threads)


def greedy(model, tok, prompt: str, n: int = 48) -> str:
    import torch
    ids = tok(prompt, return_tensors="pt")
    with torch.no_grad():
        out = model.generate(**ids, max_new_tokens=n, do_sample=False, pad_token_id=tok.pad_token_id)
    return tok.decode(out[0, ids["input_ids"].shape[1]:])


def cpu_name() -> str:
    """The CPU's model name and its widest vector ISA (what the matmul kernels can use)."""
    try:
        info = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor() or platform.machine()
    model = next((ln.split(":", 1)[1].strip() for ln in info.splitlines() if ln.startswith("model name")), "?")
    flags = next((ln.split(":", 1)[1].split() for ln in info.splitlines() if ln.startswith("flags")), [])
    isa = next((name for flag, name in (("amx_tile", "AMX"), ("avx512f", "AVX-512"), ("avx2", "AVX2"))
                if flag in flags), "no AVX2")
    return f"{model}, {isa}, {os.cpu_count()} vCPUs"


def fmt(x, nd=3):
    return f"{x:.{nd}f}"


def main(argv=None):
    import torch
    from transformers import AutoTokenizer

    ap = argparse.ArgumentParser(description="evaluate the model family, write the model card")
    ap.add_argument("--models", default="models")
    ap.add_argument("--out", default="models/README.md")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--n-seq", type=int, default=48, help="held-out windows per domain")
    a = ap.parse_args(argv)
    torch.set_num_threads(a.threads)
    root = Path(a.models)
    names = [n for n in ("target", "draft", "draft-code", "draft-large") if (root / n / "config.json").exists()]
    names += sorted(p.name for p in root.iterdir() if (p / "config.json").exists() and p.name not in names)
    assert "target" in names, "models/target is required"
    tok = AutoTokenizer.from_pretrained(str(root / "target"))
    models = {n: load(root / n) for n in names}
    info = {n: json.loads((root / n / "training.json").read_text()) if (root / n / "training.json").exists() else {}
            for n in names}
    drafts = [n for n in names if n != "target"]
    R = {"models": {}, "bigram": {}, "loss": {}, "acceptance": {}, "cost": {}, "goals": {}}

    # held-out loss + bigram
    print("held-out losses ...", flush=True)
    logits = {}
    for d in DOMAINS:
        w = windows(d, a.seq_len, a.n_seq)
        x, y = w[:, :-1], w[:, 1:]
        bg = Bigram(len(tok)).add(load_tokens(d, "train"))
        lam = bg.tune(load_tokens(d, "heldout"))
        R["bigram"][d] = {"lambda": lam, "nll": float(np.mean([bg.nll(r, lam) for r in w.numpy()]))}
        for n in names:
            lg = logits_of(models[n], x)
            R["loss"].setdefault(n, {})[d] = heldout_nll(lg, y)
            logits[(n, d)] = lg
        # acceptance matrix
        for n in drafts:
            agree, acc = acceptance(logits[("target", d)], logits[(n, d)])
            R["acceptance"].setdefault(n, {})[d] = {"greedy_agreement": agree, "expected_acceptance_T1": acc}
        for n in names:
            if n != "target":
                del logits[(n, d)]
        del logits[("target", d)]

    print("physics ...", flush=True)
    R["physics"] = {n: physics(root / n) for n in names}
    t_step = R["physics"]["target"]["batches"][1]["step_ms"]
    for n in drafts:
        R["physics"][n]["cost_ratio_batch1"] = R["physics"][n]["batches"][1]["step_ms"] / t_step

    # samples
    prose_p = read_jsonl(root / "prompts" / "prose.jsonl")[0]["prompt"]
    code_p = read_jsonl(root / "prompts" / "code.jsonl")[0]["prompt"]
    R["samples"] = {"prose": {"prompt": prose_p, "continuation": greedy(models["target"], tok, prose_p)},
                    "code": {"prompt": code_p, "continuation": greedy(models["target"], tok, code_p)}}

    for n in names:
        m = models[n]
        R["models"][n] = {"params": sum(p.numel() for p in m.parameters()), "layers": m.config.num_hidden_layers,
                          "hidden": m.config.hidden_size, "heads": m.config.num_attention_heads,
                          "intermediate": m.config.intermediate_size,
                          "train_tokens": info[n].get("train_tokens"), "train_minutes": info[n].get("train_minutes"),
                          "note": info[n].get("spec", {}).get("note", "")}

    # goals
    G = R["goals"]
    for d in GOAL_DOMAINS:
        gap = R["bigram"][d]["nll"] - R["loss"]["target"][d]
        G[f"target beats bigram by >= 0.3 nats on {d}"] = {"value": gap, "met": gap >= 0.3}
    if "draft" in R["acceptance"]:
        for d in GOAL_DOMAINS:
            v = R["acceptance"]["draft"][d]["greedy_agreement"]
            G[f"draft greedy agreement >= 0.6 on {d}"] = {"value": v, "met": v >= 0.6}
    if "draft-code" in R["acceptance"]:
        A = R["acceptance"]["draft-code"]
        gap = A["code"]["greedy_agreement"] - A["prose"]["greedy_agreement"]
        G["draft-code agreement: code minus prose >= 0.2"] = {"value": gap, "met": gap >= 0.2}
    if "draft" in R["acceptance"]:
        v = R["acceptance"]["draft"]["prose"]["greedy_agreement"]
        G["draft greedy agreement >= 0.7 on prose (served family)"] = {"value": v, "met": v >= 0.7}
        v = R["physics"]["draft"]["cost_ratio_batch1"]
        G["draft cost ratio <= 0.15 (served family)"] = {"value": v, "met": v <= 0.15}
    if "draft-large" in R["physics"]:
        v = R["physics"]["draft-large"]["cost_ratio_batch1"]
        G["draft-large cost ratio >= 0.6"] = {"value": v, "met": v >= 0.6}
    v = R["physics"]["target"]["batches"][1]["ratio"]
    G["target: verify 5 / step at batch 1 <= 1.25 (memory bound; served family)"] = {"value": v, "met": v <= 1.25}
    R["env"] = {"threads": a.threads, "torch": torch.__version__, "loadavg": os.getloadavg(), "cpu": cpu_name(),
                "when": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                "machine": platform.processor() or platform.machine()}

    out = Path(a.out)
    (out.parent / "eval.json").write_text(json.dumps(R, indent=2))
    out.write_text(card(R, names, drafts, a))
    print(out.read_text())


def card(R, names, drafts, a) -> str:
    L = []
    w = L.append
    stats = json.loads((CORPUS / "stats.json").read_text()) if (CORPUS / "stats.json").exists() else {}
    w("# Model family: target and drafts for speculative decoding\n")
    w("A Llama-layout family trained offline on a shared 2-core CPU by `python -m modelzoo.train` (each model's "
      "recipe is its row's note and `training.json`); "
      f"every number below is written by `python -m modelzoo.evaluate --models {a.models} --out {a.out}` "
      f"({R['env']['when']}, torch {R['env']['torch']}, {R['env']['threads']} threads, "
      f"load average at the end {', '.join(f'{x:.2f}' for x in R['env']['loadavg'])}). "
      "Weights: safetensors stored in fp16 with config `dtype: float32`, so a plain `from_pretrained` loads fp32; "
      "tied embeddings; one byte-level BPE tokenizer (vocab 4096, "
      "`<|endoftext|>` = bos = eos = document separator, `<|pad|>` = pad) shared by every model.\n")
    w("## Models\n")
    w("| model | params | layers | hidden | heads | ffn | training tokens | training time (min) | what |")
    w("|---|---|---|---|---|---|---|---|---|")
    for n in names:
        m = R["models"][n]
        tt = f"{m['train_tokens']:,}" if m["train_tokens"] else "-"
        w(f"| `{n}` | {m['params']:,} | {m['layers']} | {m['hidden']} | {m['heads']} | {m['intermediate']} | {tt} | "
          f"{m['train_minutes'] if m['train_minutes'] is not None else '-'} | {m['note']} |")
    w("")
    w("## Held-out loss (nats/token)\n")
    w(f"{a.n_seq} evenly spaced windows of {a.seq_len} tokens from each domain's held-out split (held-out = "
      "3% of documents, by hash of the document id). Bigram baseline: counts from the training split, "
      "p(w|v) = lam * c(v,w)/c(v) + (1 - lam) * (c(w)+1)/(N+V), lam tuned on the held-out split over "
      "{0.5, ..., 0.95}; scored on the same windows. `docs` (Python documentation) is reported but is not in any "
      "training mix.\n")
    w("| domain | bigram (lam) | " + " | ".join(f"`{n}`" for n in names) + " |")
    w("|---|---|" + "---|" * len(names))
    for d in DOMAINS:
        b = R["bigram"][d]
        w(f"| {d} | {fmt(b['nll'])} ({b['lambda']}) | " + " | ".join(fmt(R["loss"][n][d]) for n in names) + " |")
    w("")
    w("## Acceptance matrix (drafts vs `target`)\n")
    w("Teacher-forced on the same held-out windows. *agree*: fraction of positions where argmax draft == argmax "
      "target (greedy acceptance). *E[acc] T=1*: mean over positions of sum_v min(p_target(v), p_draft(v)), the exact "
      "expected acceptance of one drafted token under speculative sampling at temperature 1.\n")
    w("| draft | " + " | ".join(f"{d} agree | {d} E[acc] T=1" for d in DOMAINS) + " |")
    w("|---|" + "---|---|" * len(DOMAINS))
    for n in drafts:
        A = R["acceptance"][n]
        w(f"| `{n}` | " + " | ".join(f"{fmt(A[d]['greedy_agreement'])} | {fmt(A[d]['expected_acceptance_T1'])}"
                                     for d in DOMAINS) + " |")
    w("")
    w("## Physics: where a verify is free\n")
    w("Through the serving engine's own forward (`specdec_core.ModelRunner`: slot KV cache, context 64), 1 torch "
      "thread as a served replica runs, fp32; each number is the least of 3 medians of 5 forwards (load only adds "
      f"time). verify 5 = one forward of 5 new tokens per sequence (K = 4). Ridge: the most new tokens one batch-1 "
      f"forward takes for at most {FREE_VERIFY}x the 1-token step. Cost ratio c = a draft's 1-token step over the "
      "target's, at batch 1. Host: " + R["env"]["cpu"] + ".\n")
    w("| model | weights (MB, fp32) | " + " | ".join(f"b{b} step ms | b{b} verify 5 ms | b{b} ratio"
                                              for b in PHYSICS_BATCHES) + " | ridge (tokens) | c |")
    w("|---|---|" + "---|---|---|" * len(PHYSICS_BATCHES) + "---|---|")
    for n in names:
        P = R["physics"][n]
        cells = " | ".join(f"{P['batches'][b]['step_ms']:.2f} | {P['batches'][b]['verify5_ms']:.2f} | "
                           f"{P['batches'][b]['ratio']:.2f}" for b in PHYSICS_BATCHES)
        c = f"{P['cost_ratio_batch1']:.3f}" if "cost_ratio_batch1" in P else "1"
        w(f"| `{n}` | {P['weight_bytes'] / 1e6:.1f} | {cells} | {P['ridge_tokens']} | {c} |")
    w("")
    widths = list(R["physics"]["target"]["batch1_ms_by_width"])
    w("`target`, batch 1, ms per forward by new tokens: " + ", ".join(
        f"{q}: {t:.2f}" for q, t in R["physics"]["target"]["batch1_ms_by_width"].items())
      + f" (widths {widths[0]}-{widths[-1]}).\n")
    w("## Goals\n")
    w("| goal | value | status |")
    w("|---|---|---|")
    for g, v in R["goals"].items():
        w(f"| {g} | {fmt(v['value'])} | {'met' if v['met'] else '**MISSED**'} |")
    w("")
    w("## Greedy samples from `target`\n")
    for d in ("prose", "code"):
        s = R["samples"][d]
        w(f"**{d}** prompt:\n\n```\n{s['prompt']}\n```\n\n"
          f"continuation (48 tokens, greedy):\n\n```\n{s['continuation']}\n```\n")
    w("## Corpus and licenses\n")
    w("Built offline by `python -m modelzoo.corpus --out data/corpus` from Debian packages (`apt-get download` + "
      "`dpkg-deb -x`) and this machine's Python standard library; `data/` is git-ignored.\n")
    w("| domain | sources | train docs | held-out docs | train chars | held-out chars |")
    w("|---|---|---|---|---|---|")
    for d in DOMAINS:
        s = stats.get(d)
        if s:
            w(f"| {d} | {', '.join(s['sources'])} | {s['train_docs']} | {s['heldout_docs']} | "
              f"{s['train_chars']:,} | {s['heldout_chars']:,} |")
    w("")
    for k, v in LICENSES.items():
        w(f"- **{k}**: {v}")
    w("")
    w("Training mix: `target` 50/50 prose/code by tokens (each sequence's domain drawn with p = 0.5, sequences "
      "of equal length); the distilled drafts (`draft`, `draft-large`) the same mix unless their note says otherwise, "
      "initialised from their teacher's embedding, final norm and a subset of its layers (see the table and each "
      "model's `training.json` for the teacher), then trained with loss 0.8 * T^2 * KL(teacher || draft at T = 1.5) + "
      "0.2 * CE; `draft-code` code only, plain CE from random init. A target grown from a smaller one starts at its "
      "function exactly (`modelzoo.train.grow`). The HF greedy samples above come from small, briefly trained "
      "models: expect repetition.\n")
    w("## Prompt sets (`models/prompts/`)\n")
    w("Written from the held-out splits by `modelzoo.corpus.write_prompts`: `prose.jsonl` and `code.jsonl` (64 "
      "prompts each, 32-64 tokens), `repetitive.jsonl` (32 prompts, 48-128 tokens, the held-out windows with the "
      "highest word-3-gram repetition: where prompt lookup does well), `long.jsonl` (16 prompts of 400-600 tokens, "
      "8 prose then 8 code). Each line is `{\"prompt\": \"...\"}`.\n")
    return "\n".join(L)


if __name__ == "__main__":
    main()
