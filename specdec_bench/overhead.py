"""`specdec-bench overhead`: what the serving layer costs, side by side in one run.

The same prompts, greedy with a fixed output length, decoded by the in-process ``Engine`` (this
process, one torch thread, as one replica runs) and by a running server (``--url``, e.g. a fresh
``serve run serve_config.yaml``) with this process as the load generator: plain and co-located
speculative (K = the server's default_k), at each concurrency. In-process concurrency c is a batch
of c requests added together; served concurrency c is c closed-loop clients. Reported per cell:
tokens/s (both sides and their ratio), in-process time to first token (prefill, queueing
included) against served TTFT, per-token time, and the CPU share the load generator itself used
while the server was measured (it shares the machine's cores with the server). In-process and
served runs alternate ``--reps`` times and each cell reports medians (the ratio's range beside): this
host's speed moves by 10-25% over minutes, and one pair of runs gave served plain at 0.78x on one
server and 1.00x on the next.
"""

from __future__ import annotations

import asyncio
import resource
import statistics
import time
from pathlib import Path

import httpx
import torch

from deployments.calibrate import measuring_alone
from specdec_bench.common import MODELS_DIR, load_prompts, machine_facts
from specdec_bench.load import MODES, distinct, one_request
from specdec_core import Engine, SamplingParams


def _cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def in_process(engine: Engine, prompts: list[str], concurrency: int, k: int, max_tokens: int) -> dict:
    """Batches of ``concurrency`` requests, one batch after another (a closed loop's steady state)."""
    tokens, ttft, tpot = 0, [], []
    t0 = time.perf_counter()
    prompts = [distinct(p) for p in prompts]  # as ``one_request`` sends them: the same prompt lengths
    for start in range(0, len(prompts), concurrency):
        params = [SamplingParams(max_new_tokens=max_tokens, ignore_eos=True, num_speculative_tokens=k)
                  for _ in prompts[start:start + concurrency]]
        for out in engine.generate(prompts[start:start + concurrency], params=params):
            tokens += len(out.token_ids)
            ttft.append(out.stats.first_token_s)
            tpot.append((out.stats.latency_s - out.stats.first_token_s) / max(1, len(out.token_ids) - 1))
    wall = time.perf_counter() - t0
    return {"tok_s": tokens / wall, "ttft_ms": 1000 * statistics.median(ttft),
            "tpot_ms": 1000 * statistics.median(tpot)}


async def served(url: str, model: str, prompts: list[str], concurrency: int, mode: str, max_tokens: int) -> dict:
    args = type("Args", (), {"max_tokens": max_tokens, "temperature": 0.0})
    results, queue = [], list(range(len(prompts)))
    async with httpx.AsyncClient(base_url=url, timeout=300) as client:
        async def worker():
            while queue:
                i = queue.pop(0)
                results.append(await one_request(client, model, prompts[i], args, MODES[mode],
                                                 extra={"ignore_eos": True}))

        cpu0, t0 = _cpu_s(), time.perf_counter()
        await asyncio.gather(*[worker() for _ in range(concurrency)])
        wall, cpu = time.perf_counter() - t0, _cpu_s() - cpu0
    if any("error" in r for r in results):
        raise RuntimeError(f"served {mode} at concurrency {concurrency}: {results}")
    engine_ttft = [r["engine_ttft"] for r in results if r["engine_ttft"] is not None]
    return {"tok_s": sum(r["tokens"] for r in results) / wall,
            "ttft_ms": 1000 * statistics.median(r["ttft"] for r in results),
            # the served engines' own arrival -> first token: what of the served TTFT was their prefill
            "engine_ttft_ms": 1000 * statistics.median(engine_ttft) if engine_ttft else float("nan"),
            "tpot_ms": 1000 * statistics.median(r["tpot"] for r in results),
            "load_generator_cpu_share": cpu / wall}


def median_run(runs: list[dict]) -> dict:
    """Each field's median over repetitions."""
    return {key: statistics.median(r[key] for r in runs) for key in runs[0]}


def run_overhead(args) -> dict:
    torch.set_num_threads(args.threads)
    prompts = load_prompts(args.prompts, args.requests)
    with measuring_alone():  # the served engines' kernel bands: the two sides run the same kernels
        engine = Engine.from_pretrained(str(args.target or MODELS_DIR / "target"),
                                        str(args.draft or MODELS_DIR / "draft"), max_batch_size=max(args.concurrency))
    model = httpx.get(f"{args.url}/v1/models", timeout=30).json()["data"][0]["id"]
    cells = []
    for mode in args.modes:
        k = 0 if mode == "plain" else args.k
        for c in args.concurrency:
            in_process(engine, prompts[:c], c, k, args.max_tokens)  # warm-up
            asyncio.run(served(args.url, model, prompts[:c], c, mode, args.max_tokens))
            pairs = [(in_process(engine, prompts, c, k, args.max_tokens),
                      asyncio.run(served(args.url, model, prompts, c, mode, args.max_tokens)))
                     for _ in range(args.reps)]
            local, remote = (median_run([pair[side] for pair in pairs]) for side in (0, 1))
            ratios = sorted(b["tok_s"] / a["tok_s"] for a, b in pairs)
            cells.append({"mode": mode, "concurrency": c, "in_process": local, "served": remote,
                          "served_vs_in_process": statistics.median(ratios), "ratio_range": [ratios[0], ratios[-1]],
                          "ttft_overhead_ms": statistics.median(b["ttft_ms"] - a["ttft_ms"] for a, b in pairs)})
            print(f"{mode:9s} c={c}: in-process {local['tok_s']:.0f} tok/s, served {remote['tok_s']:.0f} tok/s "
                  f"({cells[-1]['served_vs_in_process']:.2f}x, {ratios[0]:.2f}-{ratios[-1]:.2f}), "
                  f"TTFT {local['ttft_ms']:.1f} -> {remote['ttft_ms']:.1f} ms "
                  f"(its engine's {remote['engine_ttft_ms']:.1f})", flush=True)
    config = {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items() if k != "func"}
    return {"machine": machine_facts(args.threads), "config": config, "cells": cells}


def overhead_markdown(data: dict) -> str:
    lines = ["# Serving overhead: in-process engine vs served, same prompts", "",
             f"Config: {data['config']}", "",
             ("| mode | concurrency | in-process tok/s | served tok/s | served / in-process (range) | "
              "in-process TTFT ms | served TTFT ms (its engine's) | in-process TPOT ms | served TPOT ms | "
              "load generator CPU |"),
             "|---" * 10 + "|"]
    for c in data["cells"]:
        a, b = c["in_process"], c["served"]
        lo, hi = c["ratio_range"]
        lines.append(f"| {c['mode']} | {c['concurrency']} | {a['tok_s']:.0f} | {b['tok_s']:.0f} | "
                     f"{c['served_vs_in_process']:.2f}x ({lo:.2f}-{hi:.2f}) | "
                     f"{a['ttft_ms']:.1f} | {b['ttft_ms']:.1f} ({b['engine_ttft_ms']:.1f}) | "
                     f"{a['tpot_ms']:.2f} | {b['tpot_ms']:.2f} | {100 * b['load_generator_cpu_share']:.0f}% |")
    return "\n".join(lines) + "\n"
