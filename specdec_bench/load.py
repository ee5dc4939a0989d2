"""`specdec-bench serve`: load generator against a running OpenAI-compatible server.

Streams completions (SSE) so time to first token (TTFT), time per output token (TPOT) and
inter-token latency (ITL) are measured per request; arrivals are Poisson at each given rate, or a
fixed number of concurrent clients. One pass per speculation mode (the project's extension field;
other servers ignore it). The orchestration-overhead cell is the colocated vs separate pair.

``--interleave``: the modes take turns instead, one round of ``concurrency`` requests (the same
prompts for every mode) at a time, so that a mode's number shares the machine's state with the
others'. The order of the modes changes every round along a Williams design (``williams_orders``):
over len(modes) rounds every mode follows every other exactly once, since a mode run right after
the separate topology inherits its leftover work (measured: +4-6 ms TTFT under a plain rotation).
Round 1 starts with ``auto``: on a fresh server its very first request is counted. A mode's tok/s
= its tokens / the wall time of its rounds.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import random
import statistics
import time
from pathlib import Path

import httpx
from tqdm import tqdm

from specdec_bench.common import load_prompts, machine_facts

MODES = {
    "plain": {"mode": "plain"},
    "colocated": {"mode": "speculative", "topology": "colocated"},
    "separate": {"mode": "speculative", "topology": "separate"},
    "auto": {"mode": "auto"},
}


async def one_request(client: httpx.AsyncClient, model: str, prompt: str, args, speculation: dict,
                      extra: dict | None = None) -> dict:
    body = {"model": model, "prompt": prompt, "max_tokens": args.max_tokens, "temperature": args.temperature,
            "stream": True, "stream_options": {"include_usage": True}, "speculation": speculation, **(extra or {})}
    if getattr(args, "user", None):
        body["user"] = args.user
    t0 = time.perf_counter()
    arrivals, final, done, stream_error = [], {}, False, None
    async with client.stream("POST", "/v1/completions", json=body) as resp:
        if resp.status_code != 200:
            return {"error": resp.status_code}
        async for line in resp.aiter_lines():
            if line == "data: [DONE]":
                done = True
            if not line.startswith("data: ") or done:
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                stream_error = chunk["error"]["message"]
            if chunk.get("choices") and chunk["choices"][0].get("text"):
                arrivals.append(time.perf_counter() - t0)
            if chunk.get("usage"):
                final = chunk
    end = time.perf_counter() - t0
    tokens = (final.get("usage") or {}).get("completion_tokens", len(arrivals))
    spec = final.get("speculation") or {}
    return {
        "ttft": arrivals[0] if arrivals else end,
        "tpot": (end - arrivals[0]) / max(1, tokens - 1) if arrivals else 0.0,
        "itl": [b - a for a, b in itertools.pairwise(arrivals)],
        "tokens": tokens,
        "latency": end,
        "accepted": spec.get("accepted_tokens", 0),
        "proposed": spec.get("proposed_tokens", 0),
        "route": spec.get("topology") or spec.get("mode"),
        "regime": spec.get("regime"),
        "migrations": spec.get("migrations", 0),
        "done": done,  # the stream ended with [DONE]
        "stream_error": stream_error,  # an error event's message
    }


async def run_pass(args, model: str, speculation: dict, rate: float | None) -> dict:
    prompts = load_prompts(args.prompts, None)
    rng = random.Random(0)
    results = []
    async with httpx.AsyncClient(base_url=args.url, timeout=120) as client:
        t0 = time.perf_counter()
        if rate:  # open loop: Poisson arrivals
            tasks = []
            for i in range(args.requests):
                tasks.append(asyncio.create_task(one_request(client, model, prompts[i % len(prompts)], args,
                                                             speculation)))
                await asyncio.sleep(rng.expovariate(rate))
            results = await asyncio.gather(*tasks)
        else:  # closed loop: fixed concurrency
            queue = list(range(args.requests))

            async def worker():
                while queue:
                    i = queue.pop()
                    results.append(await one_request(client, model, prompts[i % len(prompts)], args, speculation))

            await asyncio.gather(*[worker() for _ in range(args.concurrency)])
        wall = time.perf_counter() - t0
    return summarize(results, wall)


def summarize(results: list[dict], wall: float) -> dict:
    ok = [r for r in results if "error" not in r]
    itl = sorted(x for r in ok for x in r["itl"])
    pct = lambda xs, p: xs[min(len(xs) - 1, int(p * len(xs)))] if xs else 0.0
    proposed = sum(r["proposed"] for r in ok)
    return {
        "requests": len(results),
        "errors": len(results) - len(ok),
        "throughput_tok_s": sum(r["tokens"] for r in ok) / wall,
        "ttft_ms": {"p50": 1000 * pct(sorted(r["ttft"] for r in ok), 0.5),
                    "p90": 1000 * pct(sorted(r["ttft"] for r in ok), 0.9)},
        "tpot_ms": {"p50": 1000 * statistics.median(r["tpot"] for r in ok) if ok else 0.0},
        "itl_ms": {"p50": 1000 * pct(itl, 0.5), "p90": 1000 * pct(itl, 0.9), "p99": 1000 * pct(itl, 0.99)},
        "acceptance_rate": sum(r["accepted"] for r in ok) / proposed if proposed else 0.0,
        "routes": {route: sum(1 for r in ok if r["route"] == route) for route in {r["route"] for r in ok}},
        "regimes": {g: sum(1 for r in ok if r["regime"] == g) for g in {r["regime"] for r in ok}},
    }


def williams_orders(n: int) -> list[list[int]]:
    """A balanced Latin square: n orders of range(n) in which every item follows every other exactly
    once (n even; for odd n, each order and its reverse). The first order starts with 0."""
    base = [0] + [(j + 1) // 2 if j % 2 else n - j // 2 for j in range(1, n)]
    rows = [[(b + i) % n for b in base] for i in range(n)]
    return rows if n % 2 == 0 else rows + [row[::-1] for row in rows]


async def run_interleaved(args, model: str) -> list[dict]:
    """Rounds of ``concurrency`` requests per mode, in Williams-design orders, auto first in round 1."""
    prompts = load_prompts(args.prompts, None)
    modes = sorted(args.modes, key=lambda m: m != "auto")
    results: dict[str, list[dict]] = {m: [] for m in modes}
    wall = dict.fromkeys(modes, 0.0)
    first_auto = None
    rounds = max(1, args.requests // args.concurrency)
    orders = williams_orders(len(modes))
    async with httpx.AsyncClient(base_url=args.url, timeout=120) as client:
        for r in tqdm(range(rounds), desc=f"interleaved, concurrency {args.concurrency}"):
            batch = [prompts[(r * args.concurrency + i) % len(prompts)] for i in range(args.concurrency)]
            for mode in (modes[i] for i in orders[r % len(orders)]):
                t0 = time.perf_counter()
                got = await asyncio.gather(*(one_request(client, model, p, args, MODES[mode]) for p in batch))
                wall[mode] += time.perf_counter() - t0
                results[mode] += got
                if mode == "auto" and first_auto is None:
                    first_auto = got[0]
    passes = [{"mode": m, "rate": None, "concurrency": args.concurrency, **summarize(results[m], wall[m])}
              for m in modes]
    if first_auto is not None:
        passes[0]["first_request"] = {k: first_auto.get(k) for k in ("latency", "ttft", "route", "regime")}
    best = max((p for p in passes if p["mode"] != "auto"), key=lambda p: p["throughput_tok_s"], default=None)
    for p in passes:
        if best is not None and best["throughput_tok_s"] > 0:
            p["vs_best_explicit"] = p["throughput_tok_s"] / best["throughput_tok_s"]
    return passes


def run_serve(args) -> dict:
    model = args.model
    if model is None:
        model = httpx.get(f"{args.url}/v1/models", timeout=30).json()["data"][0]["id"]
    rates = args.rates or [None]
    passes = []
    if getattr(args, "interleave", False):
        passes = asyncio.run(run_interleaved(args, model))
        for p in passes:
            tqdm.write(f"{p['mode']:10s} tput {p['throughput_tok_s']:.1f} tok/s  "
                       f"x{p.get('vs_best_explicit', 0):.2f} of the best explicit  routes {p['routes']}  "
                       f"regimes {p['regimes']}  errors {p['errors']}")
        rates = []
    for rate in rates:
        for mode in tqdm(args.modes, desc=f"rate {rate or f'concurrency {args.concurrency}'}"):
            res = asyncio.run(run_pass(args, model, MODES[mode], rate))
            passes.append({"mode": mode, "rate": rate, "concurrency": None if rate else args.concurrency, **res})
            tqdm.write(f"{mode:10s} rate={rate} tput {res['throughput_tok_s']:.1f} tok/s  TTFT p50 "
                       f"{res['ttft_ms']['p50']:.0f} ms  ITL p50 {res['itl_ms']['p50']:.1f} ms  "
                       f"acc {res['acceptance_rate']:.2f}  errors {res['errors']}")
    config = {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items() if k != "func"}
    return {"machine": machine_facts(0), "config": config,
            "passes": passes}


def serve_markdown(data: dict) -> str:
    lines = ["# Serving benchmark", "", f"Config: {data['config']}", "",
             "| mode | rate | concurrency | tok/s | vs best explicit | TTFT p50 ms | TTFT p90 ms | TPOT p50 ms | "
             "ITL p50 ms | ITL p99 ms | acceptance | routes | errors |", "|---" * 13 + "|"]
    for p in data["passes"]:
        vs = f"{p['vs_best_explicit']:.2f}" if "vs_best_explicit" in p else ""
        lines.append(
            f"| {p['mode']} | {p['rate']} | {p['concurrency']} | {p['throughput_tok_s']:.1f} | {vs} | "
            f"{p['ttft_ms']['p50']:.0f} | {p['ttft_ms']['p90']:.0f} | {p['tpot_ms']['p50']:.1f} | "
            f"{p['itl_ms']['p50']:.1f} | {p['itl_ms']['p99']:.1f} | {p['acceptance_rate']:.2f} | "
            f"{p.get('routes', {})} | {p['errors']} |"
        )
    first = next((p["first_request"] for p in data["passes"] if "first_request" in p), None)
    if first:
        lines += ["", f"First auto request: {first['latency']:.2f} s, routed {first['route']} ({first['regime']})."]
    return "\n".join(lines) + "\n"
