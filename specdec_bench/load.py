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

Each pass's numbers, and the passes against the best explicit mode: ``specdec_bench/pass_summary.py``.
"""

from __future__ import annotations

import asyncio
import itertools
import random
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
from tqdm import tqdm

from specdec_bench.common import load_prompts, machine_facts
from specdec_bench.local_app import sse_event
from specdec_bench.pass_summary import compare_passes, summarize, tail_line

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
        "engine_ttft": spec.get("engine_first_token_s"),  # its engine's arrival to first token (None: a peer)
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
