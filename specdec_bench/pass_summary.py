"""One ``specdec-bench serve`` pass summarised, and the passes of a run compared.

Field names follow ``vllm bench serve``'s JSON (completed, duration, request_throughput, output_throughput,
mean/median/std/p99 of ttft, tpot, itl and e2el in ms), so they compare across tools; beside them, this
project's: steady tok/s of a closed loop (``steady_throughput``), acceptance, K as it ran, routes, regimes,
the router's predicted speedup, where the slowest TPOTs' time went (``tpot_tail``), and each pass against the
best explicit mode (``compare_passes``).
"""

from __future__ import annotations

import collections
import math
import statistics


def percentile(xs: list[float], p: float) -> float:
    """Linear-interpolated percentile (numpy's default, which ``vllm bench serve`` uses)."""
    if not xs:
        return 0.0
    xs = sorted(xs)
    at = (len(xs) - 1) * p / 100
    lo = int(at)
    return xs[lo] + (xs[min(lo + 1, len(xs) - 1)] - xs[lo]) * (at - lo)


def _latency_fields(name: str, seconds: list[float]) -> dict:
    ms = [1000 * x for x in seconds]
    return {f"mean_{name}_ms": statistics.fmean(ms) if ms else 0.0, f"median_{name}_ms": percentile(ms, 50),
            f"std_{name}_ms": statistics.pstdev(ms) if ms else 0.0, f"p99_{name}_ms": percentile(ms, 99)}


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
        out[name] = {"requests": len(mine), "median_tpot_ms": percentile(tpot, 50),
                     "p99_tpot_ms": percentile(tpot, 99),
                     "acceptance_rate": sum(r["accepted"] for r in mine) / proposed if proposed else 0.0,
                     "routes": {g: sum(1 for r in mine if r["route"] == g) for g in {r["route"] for r in mine}}}
    return out


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
