"""`specdec-bench serve`: load generator against a running OpenAI-compatible server.

Streams completions (SSE) so time to first token (TTFT), time per output token (TPOT) and
inter-token latency (ITL) are measured per request; arrivals are Poisson at each given rate, or a
fixed number of concurrent clients. One pass per speculation mode (the project's extension field;
other servers ignore it). The orchestration-overhead cell is the colocated vs separate pair.

``--interleave``: the modes take turns instead, one round per mode at a time (the same prompts for
every mode; ``round_size``: 4 requests per client unless ``--round-requests`` says, with the
concurrency held as in a pass), so that a mode's number shares the machine's state with the
others'. The order of the modes changes every round along a Williams design (``williams_orders``):
over len(modes) rounds every mode follows every other exactly once, since a mode run right after
the separate topology inherits its leftover work (measured: +4-6 ms TTFT under a plain rotation).
Round 1 starts with ``auto``: on a fresh server its very first request is counted. A mode's tok/s
= its tokens / the wall time of its rounds.

``--mix SET:T[:USER] ...``: a mixed load. Request i is profile i mod n (a prompt set, a temperature
and an OpenAI ``user``, i.e. a traffic class), so every round of a closed loop holds every profile,
as when some users sample prose at T=1 and others complete code greedily beside them. Each pass
reports its profiles' latencies and acceptance on their own (``by_profile``).
"""

from __future__ import annotations

import asyncio
import collections
import itertools
import math
import random
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
from tqdm import tqdm

from specdec_bench.common import load_prompts, machine_facts
from specdec_bench.local_app import sse_event

MODES = {
    "plain": {"mode": "plain"},
    "colocated": {"mode": "speculative", "topology": "colocated"},
    "separate": {"mode": "speculative", "topology": "separate"},
    "auto": {"mode": "auto"},
}


def speculation_of(mode: str) -> dict:
    """A mode's ``speculation`` field: one of ``MODES``, or ``colocated:K`` / ``separate:K`` (a fixed K)."""
    topology, _, k = mode.partition(":")
    if not k:
        return MODES[mode]
    return {**MODES[topology], "num_speculative_tokens": int(k)}


# Servers keep prompts' K/V (automatic prefix caching: this one's blocks of 16, vLLM's of 128 on CPU),
# and a prompt set of 64 repeats across passes and across the modes of an interleaved round, where a
# later mode would find what an earlier one left. So each request's prompt starts with a number of its
# own, its first block is its own, and no request finds another's prefix; ``--reuse-prompts`` sends
# the prompts as they are (what caching buys on repeated prompts).
_request_numbers = itertools.count(1)


def distinct(prompt: str) -> str:
    return f"{next(_request_numbers)}. {prompt}"


@dataclass(frozen=True)
class Profile:
    """One kind of traffic in a load: what its requests ask for and who sends them."""

    prompts: str  # a prompt set under models/prompts
    temperature: float
    user: str | None = None

    @classmethod
    def parse(cls, spec: str) -> Profile:
        """``SET:T[:USER]``, e.g. ``code:0:coder``."""
        parts = spec.split(":")
        if len(parts) not in (2, 3) or not parts[0]:
            raise ValueError(f"a --mix profile is SET:TEMPERATURE[:USER], got {spec!r}")
        return cls(parts[0], float(parts[1]), parts[2] if len(parts) == 3 and parts[2] else None)

    @property
    def name(self) -> str:
        return f"{self.prompts}:{self.temperature:g}" + (f":{self.user}" if self.user else "")


class Traffic:
    """Request i of a load: its prompt and its body's per-request fields. One profile (``--prompts``,
    ``--temperature``, ``--user``) unless ``--mix`` gives several; request i is profile i mod n."""

    def __init__(self, args):
        mix = getattr(args, "mix", None)
        self.profiles = ([Profile.parse(m) for m in mix] if mix else
                         [Profile(args.prompts, args.temperature, getattr(args, "user", None))])
        self._prompts = {p.prompts: load_prompts(p.prompts, None) for p in self.profiles}

    def profile(self, i: int) -> Profile:
        return self.profiles[i % len(self.profiles)]

    def request(self, i: int) -> tuple[str, dict]:
        """(prompt, body fields) of request i: the profile's prompts in order."""
        profile = self.profile(i)
        prompts = self._prompts[profile.prompts]
        fields = {"temperature": profile.temperature}
        if profile.user:
            fields["user"] = profile.user
        return prompts[(i // len(self.profiles)) % len(prompts)], fields


async def one_request(client: httpx.AsyncClient, model: str, prompt: str, args, speculation: dict,
                      extra: dict | None = None) -> dict:
    if not getattr(args, "reuse_prompts", False):
        prompt = distinct(prompt)
    body = {"model": model, "prompt": prompt, "max_tokens": args.max_tokens, "temperature": args.temperature,
            "stream": True, "stream_options": {"include_usage": True}, **(extra or {})}
    if speculation is not None:  # None: a server without the extension field (a peer)
        body["speculation"] = speculation
    if getattr(args, "user", None) and "user" not in body:
        body["user"] = args.user
    t0 = time.perf_counter()
    arrivals, final, done, stream_error = [], {}, False, None
    async with client.stream("POST", "/v1/completions", json=body) as resp:
        if resp.status_code != 200:
            return {"error": resp.status_code}
        async for line in resp.aiter_lines():
            chunk = sse_event(line)
            done = done or chunk == "[DONE]"
            if not isinstance(chunk, dict) or done:
                continue
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
        "verify_steps": spec.get("verify_steps", 0),
        "plain_steps": spec.get("plain_steps", 0),
        "plain_by_cause": spec.get("plain_steps_by_cause") or {},
        "routed_k": spec.get("num_speculative_tokens", 0),
        "route": spec.get("topology") or spec.get("mode"),
        "regime": spec.get("regime"),
        "route_reason": spec.get("route_reason"),
        # the router's predicted speedup over plain decoding for the route it chose (plain: 1)
        "predicted": spec.get("predicted_speedup") or 1.0,
        "migrations": spec.get("migrations", 0),
        # its engine's decode steps by the engine's clock, and the other requests' prefills it waited for
        "decode_s": spec.get("decode_s", 0.0),
        "prefill_wait_s": spec.get("prefill_wait_s", 0.0),
        "done": done,  # the stream ended with [DONE]
        "stream_error": stream_error,  # an error event's message
        "profile": None,  # the load's profile name, set by the caller
    }


def auth_headers(args) -> dict:
    """The bearer token of a server started with an API key (``args.api_key``), else none."""
    key = getattr(args, "api_key", None)
    return {"Authorization": f"Bearer {key}"} if key else {}


async def traffic_request(client: httpx.AsyncClient, model: str, traffic: Traffic, i: int, args,
                          speculation: dict | None) -> dict:
    """Request i of the load, tagged with its profile."""
    prompt, fields = traffic.request(i)
    result = await one_request(client, model, prompt, args, speculation, fields)
    result["profile"] = traffic.profile(i).name
    return result


async def run_pass(args, model: str, speculation: dict | None, rate: float | None) -> dict:
    traffic = Traffic(args)
    rng = random.Random(0)
    results = []
    async with httpx.AsyncClient(base_url=args.url, timeout=120, headers=auth_headers(args)) as client:
        t0 = time.perf_counter()
        if rate:  # open loop: Poisson arrivals
            tasks = []
            for i in range(args.requests):
                tasks.append(asyncio.create_task(traffic_request(client, model, traffic, i, args, speculation)))
                await asyncio.sleep(rng.expovariate(rate))
            results = await asyncio.gather(*tasks)
        else:  # closed loop: fixed concurrency
            results = await closed_loop(client, model, traffic, range(args.requests), args, speculation)
        wall = time.perf_counter() - t0
    return summarize(results, wall, None if rate else args.concurrency)


async def closed_loop(client: httpx.AsyncClient, model: str, traffic: Traffic, requests: range, args,
                      speculation: dict | None) -> list[dict]:
    """``requests`` sent by ``args.concurrency`` clients, each sending its next as its last finishes
    (``vllm bench serve --max-concurrency``): the load stays at the concurrency until the queue runs out."""
    queue = list(requests)[::-1]
    results, idle_at = [], []

    async def client_loop():
        while queue:
            i = queue.pop()
            result = await traffic_request(client, model, traffic, i, args, speculation)
            result["finished_at"] = time.perf_counter()
            results.append(result)
        idle_at.append(time.perf_counter())

    await asyncio.gather(*[client_loop() for _ in range(args.concurrency)])
    # Once the first client finds the queue empty, the load drains: the requests still running finish in a
    # batch that shrinks, so their latencies are not the concurrency's
    for result in results:
        result["full_load"] = result.pop("finished_at") <= min(idle_at)
    return results


def _percentile(xs: list[float], p: float) -> float:
    """Linear-interpolated percentile (numpy's default, which ``vllm bench serve`` uses)."""
    if not xs:
        return 0.0
    xs = sorted(xs)
    at = (len(xs) - 1) * p / 100
    lo = int(at)
    return xs[lo] + (xs[min(lo + 1, len(xs) - 1)] - xs[lo]) * (at - lo)


def _latency_fields(name: str, seconds: list[float]) -> dict:
    ms = [1000 * x for x in seconds]
    return {f"mean_{name}_ms": statistics.fmean(ms) if ms else 0.0, f"median_{name}_ms": _percentile(ms, 50),
            f"std_{name}_ms": statistics.pstdev(ms) if ms else 0.0, f"p99_{name}_ms": _percentile(ms, 99)}


def steady_throughput(results: list[dict], concurrency: int | None) -> float | None:
    """Output tok/s of a closed loop held at its concurrency: by Little's law, N clients that never wait
    between requests complete N / (mean latency) requests a second, so N x (their tokens / their latency),
    over the requests that ran at the full load (``full_load``; all of them if none did). A pass's wall time
    also holds its drain, where clients that ran out of requests idle until the slowest finishes, once per
    round in an interleaved run; and the requests still running in a drain finish faster than the load's,
    in a batch that shrinks, so over all requests this rate ran 5-7% above the wall's for speculative modes
    at c >= 4. Over the full-load requests it stayed within 0.3% of the wall's with 16 requests per client a
    round, 0-4% with 4 (BENCHMARKS.md, "The whole request priced; steady throughput"). None for an open loop."""
    ok = [r for r in results if "error" not in r]
    steady = [r for r in ok if r.get("full_load")] or ok
    latency = sum(r["latency"] for r in steady)
    if not concurrency or not latency:
        return None
    return concurrency * sum(r["tokens"] for r in steady) / latency


def summarize(results: list[dict], wall: float, concurrency: int | None = None) -> dict:
    """One pass's numbers in ``vllm bench serve``'s JSON field names (completed, duration,
    request_throughput, output_throughput, mean/median/std/p99 of ttft, tpot, itl and e2el in ms),
    so they compare across tools, plus this project's acceptance, routes and regimes."""
    ok = [r for r in results if "error" not in r]
    proposed = sum(r["proposed"] for r in ok)
    output = sum(r["tokens"] for r in ok)
    verify, plain = (sum(r.get(f, 0) for r in ok) for f in ("verify_steps", "plain_steps"))
    return {
        "requests": len(results),
        "errors": len(results) - len(ok),
        "completed": len(ok),
        "duration": wall,
        "total_output_tokens": output,
        "request_throughput": len(ok) / wall if wall else 0.0,
        "output_throughput": output / wall if wall else 0.0,
        "steady_output_throughput": steady_throughput(results, concurrency),
        **_latency_fields("ttft", [r["ttft"] for r in ok]),
        **_latency_fields("tpot", [r["tpot"] for r in ok if r["tokens"] > 1]),
        **_latency_fields("itl", [x for r in ok for x in r["itl"]]),
        **_latency_fields("e2el", [r["latency"] for r in ok]),
        "acceptance_rate": sum(r["accepted"] for r in ok) / proposed if proposed else 0.0,
        # K as it ran: draft tokens per speculative step, and the share of decode steps at K=0
        "mean_k": proposed / verify if verify else 0.0,
        "plain_step_share": plain / (verify + plain) if verify + plain else 0.0,
        # of auto's K=0 decode steps in speculative pools: what set K to 0 (``RequestStats.plain_by_cause``)
        "plain_step_causes": dict(sum((collections.Counter(r.get("plain_by_cause") or {}) for r in ok),
                                      collections.Counter())),
        "predicted_speedup": predicted_speedup(ok),
        "routed_k": {k: sum(1 for r in ok if r.get("routed_k") == k) for k in {r.get("routed_k") for r in ok}},
        "routes": {route: sum(1 for r in ok if r["route"] == route) for route in {r["route"] for r in ok}},
        "regimes": {g: sum(1 for r in ok if r["regime"] == g) for g in {r["regime"] for r in ok}},
        # each request's route and the router's reason, in the order they finished: why auto went where it did
        "decisions": [[r["route"], r.get("routed_k"), r.get("route_reason")] for r in ok],
        **({"by_profile": by_profile(ok)} if len({r.get("profile") for r in ok}) > 1 else {}),
        "tpot_tail": tpot_tail(ok),
    }


def tail_line(tail: dict | None) -> str:
    if not tail:
        return ""
    t = tail["slowest"]
    return (f"slowest TPOT {t['tpot_ms']:.1f} ms: own steps {t['step_share']:.0%}, others' prefills "
            f"{t['prefill_wait_share']:.0%}, acceptance {t['acceptance_rate']:.2f}, mean K {t['mean_k']:.2f}")


def tpot_tail(results: list[dict], share: float = 0.02) -> dict:
    """Where the slowest TPOTs' time went: the slowest ``share`` of requests by TPOT (at least 2, the
    ones a p99 falls between) against every request, each as the share of its decode time by the
    client's clock that its own engine steps took (``decode_s``) and that the other requests' prefills
    took (``prefill_wait_s``; the rest is the serving layer's), its acceptance and its mean K (draft tokens
    per target pass, its prefill's included: a K lowered by adaptive K counts its plain steps). A slow tail
    of low-acceptance rows and one of rows that sat through other requests' prefills need other fixes."""
    timed = sorted((r for r in results if r["tokens"] > 1), key=lambda r: r["tpot"])
    if not timed:
        return {}
    slowest = timed[-max(2, math.ceil(share * len(timed))):]

    def parts(group: list[dict]) -> dict:
        wall = sum(r["latency"] - r["ttft"] for r in group) or 1.0
        proposed = sum(r["proposed"] for r in group)
        steps = sum(r["verify_steps"] + r["plain_steps"] for r in group)
        return {"requests": len(group), "tpot_ms": 1000 * statistics.fmean(r["tpot"] for r in group),
                "step_share": sum(r["decode_s"] for r in group) / wall,
                "prefill_wait_share": sum(r["prefill_wait_s"] for r in group) / wall,
                "acceptance_rate": sum(r["accepted"] for r in group) / proposed if proposed else 0.0,
                "mean_k": proposed / steps if steps else 0.0}

    return {"slowest": parts(slowest), "all": parts(timed)}


def predicted_speedup(results: list[dict]) -> float:
    """What the router predicted for a pass, over plain decoding: each request's tokens take 1 / its
    route's predicted speedup of their plain time, so the pass's is its tokens over that time (a mode
    that routed some requests plain, at 1, counts them so)."""
    tokens = sum(r["tokens"] for r in results)
    plain_time = sum(r["tokens"] / r["predicted"] for r in results if r["predicted"] > 0)
    return tokens / plain_time if plain_time else 1.0


def by_profile(results: list[dict]) -> dict:
    """Per profile of a mixed load: requests, TPOT median and p99, acceptance and routes (its
    throughput is the pass's: the profiles share the wall time)."""
    out = {}
    for name in sorted({r["profile"] for r in results}):
        mine = [r for r in results if r["profile"] == name]
        proposed = sum(r["proposed"] for r in mine)
        tpot = [1000 * r["tpot"] for r in mine if r["tokens"] > 1]
        out[name] = {"requests": len(mine), "median_tpot_ms": _percentile(tpot, 50),
                     "p99_tpot_ms": _percentile(tpot, 99),
                     "acceptance_rate": sum(r["accepted"] for r in mine) / proposed if proposed else 0.0,
                     "routes": {g: sum(1 for r in mine if r["route"] == g) for g in {r["route"] for r in mine}}}
    return out


def williams_orders(n: int) -> list[list[int]]:
    """A balanced Latin square: n orders of range(n) in which every item follows every other exactly
    once (n even; for odd n, each order and its reverse). The first order starts with 0."""
    base = [0] + [(j + 1) // 2 if j % 2 else n - j // 2 for j in range(1, n)]
    rows = [[(b + i) % n for b in base] for i in range(n)]
    return rows if n % 2 == 0 else rows + [row[::-1] for row in rows]


def round_size(args) -> int:
    """Requests per mode in an interleaved round: ``--round-requests``, by default 4 per client. A round
    ends when its slowest request does; at one request per client each round was a burst that drained
    to its straggler, and at c=16 on code that tail was 16% of the co-located pass's wall time (its
    mean latency was 9% below plain's and its tok/s 8% below)."""
    return min(args.requests, getattr(args, "round_requests", None) or 4 * args.concurrency)


async def run_interleaved(args, model: str) -> list[dict]:
    """Rounds of ``round_size`` requests per mode, each a closed loop at the concurrency, in Williams-design
    orders, auto first in round 1."""
    traffic = Traffic(args)
    modes = sorted(args.modes, key=lambda m: m != "auto")
    results: dict[str, list[dict]] = {m: [] for m in modes}
    wall = dict.fromkeys(modes, 0.0)
    first_auto = None
    size = round_size(args)
    rounds = max(1, args.requests // size)
    orders = williams_orders(len(modes))
    async with httpx.AsyncClient(base_url=args.url, timeout=120, headers=auth_headers(args)) as client:
        for r in tqdm(range(rounds), desc=f"interleaved, concurrency {args.concurrency}"):
            batch = range(r * size, (r + 1) * size)  # request numbers: the same in every mode
            for mode in (modes[i] for i in orders[r % len(orders)]):
                t0 = time.perf_counter()
                got = await closed_loop(client, model, traffic, batch, args, speculation_of(mode))
                wall[mode] += time.perf_counter() - t0
                results[mode] += got
                if mode == "auto" and first_auto is None:
                    first_auto = got[0]
    passes = [{"mode": m, "rate": None, "concurrency": args.concurrency,
               **summarize(results[m], wall[m], args.concurrency)} for m in modes]
    if first_auto is not None:
        passes[0]["first_request"] = {k: first_auto.get(k) for k in ("latency", "ttft", "route", "regime")}
    compare_passes(passes)
    return passes


def compare_passes(passes: list[dict]) -> None:
    """Each pass against the best explicit mode, by wall tok/s (``vs_best_explicit``) and by steady tok/s
    (``*_steady``): its throughput's ratio and its p99 TPOT's, and against plain's wall tok/s (``vs_plain``,
    measured beside ``predicted_speedup``)."""
    explicit = [p for p in passes if p["mode"] != "auto"]
    plain = next((p for p in passes if p["mode"] == "plain"), None)
    for field, suffix in (("output_throughput", ""), ("steady_output_throughput", "_steady")):
        best = max((p for p in explicit if p.get(field)), key=lambda p: p[field], default=None)
        if best is None:
            continue
        for p in passes:
            p["best_explicit" + suffix] = best["mode"]
            p["vs_best_explicit" + suffix] = (p.get(field) or 0.0) / best[field]
            if best["p99_tpot_ms"] > 0:
                p["p99_tpot_vs_best" + suffix] = p["p99_tpot_ms"] / best["p99_tpot_ms"]
    for p in passes:
        if plain is not None and plain["output_throughput"] > 0:
            p["vs_plain"] = p["output_throughput"] / plain["output_throughput"]


def run_serve(args) -> dict:
    model = args.model
    if model is None:
        model = httpx.get(f"{args.url}/v1/models", timeout=30).json()["data"][0]["id"]
    rates = args.rates or [None]
    passes = []
    if getattr(args, "interleave", False):
        passes = asyncio.run(run_interleaved(args, model))
        for p in passes:
            tqdm.write(f"{p['mode']:10s} tput {p['output_throughput']:.1f} tok/s "
                       f"(steady {p['steady_output_throughput'] or 0:.1f}, "
                       f"x{p.get('vs_best_explicit_steady', 0):.2f} of the best explicit)  TTFT p50/p99 "
                       f"{p['median_ttft_ms']:.0f}/{p['p99_ttft_ms']:.0f} ms  TPOT p50/p99 "
                       f"{p['median_tpot_ms']:.1f}/{p['p99_tpot_ms']:.1f} ms  "
                       f"x{p.get('vs_best_explicit', 0):.2f} of the best explicit  mean K {p['mean_k']:.2f}  "
                       f"K=0 steps {p['plain_step_share']:.0%} {p['plain_step_causes'] or ''}  "
                       f"vs plain predicted {p['predicted_speedup']:.2f} "
                       f"measured {p.get('vs_plain', float('nan')):.2f}  routed K {p['routed_k']}  "
                       f"routes {p['routes']}  "
                       f"regimes {p['regimes']}  errors {p['errors']}  {tail_line(p.get('tpot_tail'))}")
        rates = []
    for rate in rates:
        for mode in tqdm(args.modes, desc=f"rate {rate or f'concurrency {args.concurrency}'}"):
            res = asyncio.run(run_pass(args, model, speculation_of(mode), rate))
            passes.append({"mode": mode, "rate": rate, "concurrency": None if rate else args.concurrency, **res})
            tqdm.write(f"{mode:10s} rate={rate} tput {res['output_throughput']:.1f} tok/s  TTFT p50/p99 "
                       f"{res['median_ttft_ms']:.0f}/{res['p99_ttft_ms']:.0f} ms  TPOT p50/p99 "
                       f"{res['median_tpot_ms']:.1f}/{res['p99_tpot_ms']:.1f} ms  ITL p50/p99 "
                       f"{res['median_itl_ms']:.1f}/{res['p99_itl_ms']:.1f} ms  "
                       f"acc {res['acceptance_rate']:.2f}  errors {res['errors']}")
    config = {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items() if k != "func"}
    return {"machine": machine_facts(0), "config": config,
            "passes": passes}


def serve_markdown(data: dict) -> str:
    lines = ["# Serving benchmark", "", f"Config: {data['config']}", "",
             "| mode | rate | concurrency | tok/s | vs best explicit | steady tok/s | vs best explicit, steady "
             "(its p99 TPOT's) | vs plain: predicted / measured | "
             "TTFT p50 ms | TTFT p99 ms | TPOT p50 ms | "
             "TPOT p99 ms | ITL p50 ms | ITL p99 ms | E2E p50 ms | E2E p99 ms | acceptance | mean K | K=0 steps | "
             "routes | errors |",
             "|---" * 21 + "|"]
    for p in data["passes"]:
        vs = f"{p['vs_best_explicit']:.2f}" if "vs_best_explicit" in p else ""
        steady = f"{p['steady_output_throughput']:.1f}" if p.get("steady_output_throughput") else "-"
        vs_steady = (f"{p['vs_best_explicit_steady']:.2f} ({p.get('p99_tpot_vs_best_steady', 0):.2f})"
                     if "vs_best_explicit_steady" in p else "")
        measured = f"{p['vs_plain']:.2f}" if "vs_plain" in p else "-"
        lines.append(
            f"| {p['mode']} | {p['rate']} | {p['concurrency']} | {p['output_throughput']:.1f} | {vs} | {steady} | "
            f"{vs_steady} | {p.get('predicted_speedup', 1.0):.2f} / {measured} | "
            f"{p['median_ttft_ms']:.0f} | {p['p99_ttft_ms']:.0f} | {p['median_tpot_ms']:.1f} | "
            f"{p['p99_tpot_ms']:.1f} | {p['median_itl_ms']:.1f} | {p['p99_itl_ms']:.1f} | "
            f"{p['median_e2el_ms']:.0f} | {p['p99_e2el_ms']:.0f} | {p['acceptance_rate']:.2f} | "
            f"{p.get('mean_k', 0):.2f} | {p.get('plain_step_share', 0):.0%} | {p.get('routes', {})} | {p['errors']} |"
        )
    for p in data["passes"]:
        for name, q in p.get("by_profile", {}).items():
            lines.append(f"| {p['mode']}: {name} |" + " |" * 9 + f" {q['median_tpot_ms']:.1f} | {q['p99_tpot_ms']:.1f} "
                         f"| | | | | {q['acceptance_rate']:.2f} | | | {q['routes']} | |")
    tails = [p for p in data["passes"] if p.get("tpot_tail")]
    if tails:
        lines += ["", "Where the slowest TPOTs went (the slowest 2% of requests, at least 2, against all: the share of "
                  "their decode time in their own engine steps and in other requests' prefills; acceptance, mean K):",
                  "", "| mode | requests | TPOT ms | own steps | others' prefills | acceptance | mean K |",
                  "|---" * 7 + "|"]
        for p in tails:
            for group in ("slowest", "all"):
                t = p["tpot_tail"][group]
                lines.append(f"| {p['mode']}: {group} | {t['requests']} | {t['tpot_ms']:.1f} | {t['step_share']:.0%} | "
                             f"{t['prefill_wait_share']:.0%} | {t['acceptance_rate']:.2f} | {t['mean_k']:.2f} |")
    first = next((p["first_request"] for p in data["passes"] if "first_request" in p), None)
    if first:
        lines += ["", f"First auto request: {first['latency']:.2f} s, routed {first['route']} ({first['regime']})."]
    return "\n".join(lines) + "\n"
