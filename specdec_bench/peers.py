"""`specdec-bench peers`: this engine next to HF transformers on the same model pair, in one run.

- batch 1: HF ``generate`` (plain) and ``generate(assistant_model=draft)`` (HF assisted generation,
  adaptive K, batch 1 only) vs this engine's plain and speculative decoding;
- batch 16: HF batched ``generate`` vs this engine's plain decoding (continuous batching);
- the engine's per-step framework overhead (step time minus the target forward).
Greedy everywhere, fixed output length (EOS ignored), interleaved repetitions, medians.
"""

from __future__ import annotations

import statistics
import time

import torch
from tqdm import tqdm
from transformers import AutoModelForCausalLM

from specdec_bench.common import MODELS_DIR, load_prompts, machine_facts
from specdec_core import Engine, SamplingParams


def _hf_generate(model, ids: torch.Tensor, new: int, assistant=None) -> float:
    kw = dict(max_new_tokens=new, min_new_tokens=new, do_sample=False, attention_mask=torch.ones_like(ids),
              pad_token_id=0)
    if assistant is not None:
        kw["assistant_model"] = assistant
    t0 = time.perf_counter()
    with torch.inference_mode():
        model.generate(ids, **kw)
    return time.perf_counter() - t0


def _engine_generate(engine: Engine, prompts: list[list[int]], new: int, k: int) -> float:
    params = [SamplingParams(max_new_tokens=new, ignore_eos=True, num_speculative_tokens=k) for _ in prompts]
    t0 = time.perf_counter()
    engine.generate(prompts, params=params)
    return time.perf_counter() - t0


def run_peers(args) -> dict:
    torch.set_num_threads(args.threads)
    models_dir = args.models or MODELS_DIR
    target_path, draft_path = str(models_dir / "target"), str(models_dir / args.draft)
    new = 32 if args.quick else 64
    reps = args.reps or (3 if args.quick else 5)
    engine = Engine.from_pretrained(target_path, draft_path, max_batch_size=16, max_model_len=1024)
    target = AutoModelForCausalLM.from_pretrained(target_path, dtype=torch.float32).eval()
    draft = AutoModelForCausalLM.from_pretrained(draft_path, dtype=torch.float32).eval()
    prompts = [engine.encode(p)[:48] for p in load_prompts("prose", 16, models_dir)]
    # Equal-length prompts so HF batched generate needs no padding (its fastest case).
    width = min(len(p) for p in prompts)
    prompts = [p[:width] for p in prompts]
    one = torch.tensor([prompts[0]])
    batch16 = torch.tensor(prompts[:16])
    runs = {
        "hf_plain_b1": lambda: _hf_generate(target, one, new),
        "hf_assisted_b1": lambda: _hf_generate(target, one, new, assistant=draft),
        "engine_plain_b1": lambda: _engine_generate(engine, prompts[:1], new, 0),
        "engine_spec_b1": lambda: _engine_generate(engine, prompts[:1], new, args.k),
        "hf_plain_b16": lambda: _hf_generate(target, batch16, new),
        "engine_plain_b16": lambda: _engine_generate(engine, prompts[:16], new, 0),
    }
    tokens = {name: new * (16 if name.endswith("b16") else 1) for name in runs}
    for fn in runs.values():  # warm-up
        fn()
    times = {name: [] for name in runs}
    for rep in tqdm(range(reps), desc="peers", unit="rep"):
        names = list(runs)
        names = names[rep % len(names):] + names[: rep % len(names)]
        for name in names:
            times[name].append(runs[name]())
    tok_s = {name: tokens[name] / statistics.median(t) for name, t in times.items()}
    forward_b1 = engine.target.time_step(1, 1, width + new // 2, repeats=7)
    forward_b16 = engine.target.time_step(16, 1, width + new // 2, repeats=7)
    return {
        "machine": machine_facts(args.threads),
        "config": {"target": target_path, "draft": draft_path, "new_tokens": new, "reps": reps, "k": args.k,
                   "prompt_tokens": width},
        "tok_s": tok_s,
        "ratios": {
            "engine_spec_b1_over_hf_assisted_b1": tok_s["engine_spec_b1"] / tok_s["hf_assisted_b1"],
            "engine_plain_b1_over_hf_plain_b1": tok_s["engine_plain_b1"] / tok_s["hf_plain_b1"],
            "engine_plain_b16_over_hf_plain_b16": tok_s["engine_plain_b16"] / tok_s["hf_plain_b16"],
            "engine_spec_b1_over_engine_plain_b1": tok_s["engine_spec_b1"] / tok_s["engine_plain_b1"],
        },
        "engine_step_overhead_ms": {
            "b1": 1000 * (1 / tok_s["engine_plain_b1"] - forward_b1),
            "b16": 1000 * (16 / tok_s["engine_plain_b16"] - forward_b16),
        },
        "target_forward_ms": {"b1": 1000 * forward_b1, "b16": 1000 * forward_b16},
    }


def peers_markdown(data: dict) -> str:
    m = data["machine"]
    lines = [
        "# Peers: this engine vs HF transformers (same models, greedy, one run)",
        "",
        f"Machine: {m['cpu']}, torch threads {m['torch_threads']}, load average {m['load_average_1m']:.2f}, "
        f"{m['time']}. Config: {data['config']}",
        "",
        "| run | tokens/s |",
        "|---|---|",
    ]
    lines += [f"| {name} | {v:.1f} |" for name, v in data["tok_s"].items()]
    lines += ["", "| ratio | value |", "|---|---|"]
    lines += [f"| {name} | {v:.2f} |" for name, v in data["ratios"].items()]
    o = data["engine_step_overhead_ms"]
    f = data["target_forward_ms"]
    lines += ["", f"Engine per-step overhead beyond the target forward: {o['b1']:.2f} ms at batch 1 "
              f"(forward {f['b1']:.2f} ms), {o['b16']:.2f} ms at batch 16 (forward {f['b16']:.2f} ms)."]
    return "\n".join(lines) + "\n"
