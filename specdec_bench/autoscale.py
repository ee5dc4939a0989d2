"""`specdec-bench autoscale`: the plain pool autoscaled across nodes (issue 38).

The config's app on a head and two worker nodes of this machine (``specdec_bench/nodes.py``: a plain
replica takes a worker's whole ``plain_slot``, so a second replica can only land on the other worker)
with ``plain.autoscaling`` on (``autoscaling/scaling.py``'s policy: min 1, max 2 replicas,
``--target-ongoing`` sequences per replica, ``--up-delay`` / ``--down-delay``), and a load step of
explicit plain requests (closed loop): ``--low`` concurrency for ``--before`` seconds, ``--high`` for
``--step`` seconds, ``--low`` again for ``--after`` seconds. Every ``SAMPLE_S`` the plain pool's live
replicas and their nodes are sampled. Reported: when a second replica was up (seconds after the
step) and on which node, when the pool was back to one, tokens/s and lost requests per phase.
"""

from __future__ import annotations

import asyncio
import statistics
import time

import httpx

from specdec_bench import load
from specdec_bench.common import load_prompts, machine_facts

SAMPLE_S = 2.0
PLAIN = load.MODES["plain"]


def autoscaled(args: dict, cli) -> dict:
    """The app's args with the plain pool autoscaled as the command line says."""
    plain = {**args.get("plain", {}), "autoscaling": {
        "enabled": True, "min_replicas": 1, "max_replicas": 2, "target_ongoing_requests": cli.target_ongoing,
        "upscale_delay_s": cli.up_delay, "downscale_delay_s": cli.down_delay}}
    plain.pop("num_replicas", None)
    return {**args, "plain": plain}


async def _run(args, url: str, nodes) -> dict:
    from specdec_bench.nodes import replica_nodes

    prompts = load_prompts(args.prompts)
    phases = [("before", args.low, args.before), ("step", args.high, args.step), ("after", args.low, args.after)]
    results, samples = [], []  # results: (phase, ok, tokens, end s); samples: (s, [node names])
    t0 = time.monotonic()
    ends, t = [], 0.0
    for _, _, seconds in phases:
        t += seconds
        ends.append(t)

    def phase_at(s: float) -> int | None:
        return next((i for i, end in enumerate(ends) if s < end), None)

    async with httpx.AsyncClient(base_url=url, timeout=300) as client:
        model = (await client.get("/v1/models")).json()["data"][0]["id"]

        async def worker(slot: int):
            n = slot
            while (i := phase_at(time.monotonic() - t0)) is not None:
                if slot >= phases[i][1]:  # this slot idles in this phase
                    await asyncio.sleep(0.2)
                    continue
                r = await load.one_request(client, model, prompts[n % len(prompts)], args, PLAIN, {"ignore_eos": True})
                ok = "error" not in r and r["done"] and r["tokens"] == args.max_tokens
                results.append((i, ok, r.get("tokens", 0), time.monotonic() - t0))
                n += args.high

        async def sampler():
            while phase_at(time.monotonic() - t0) is not None:
                ids = await asyncio.to_thread(replica_nodes, args.app, "PlainPool")
                samples.append((round(time.monotonic() - t0, 1), sorted(nodes.name_of(n) for n in ids)))
                await asyncio.sleep(SAMPLE_S)

        await asyncio.gather(sampler(), *[worker(s) for s in range(max(args.low, args.high))])
    return summarise(phases, ends, results, samples)


def summarise(phases, ends, results, samples) -> dict:
    starts = [0.0, *ends[:-1]]
    rows = []
    for i, (name, concurrency, seconds) in enumerate(phases):
        done = [r for r in results if r[0] == i]
        rows.append({"phase": name, "concurrency": concurrency, "seconds": seconds, "requests": len(done),
                     "lost": sum(1 for r in done if not r[1]),
                     "tok_s": sum(r[2] for r in done if r[1]) / seconds,
                     "replicas_median": statistics.median([len(n) for s, n in samples
                                                           if starts[i] <= s < ends[i]] or [0])})
    step_at = starts[1]
    up = next(((s, n) for s, n in samples if s >= step_at and len(n) >= 2), None)
    down = next(((s, n) for s, n in samples if up and s > up[0] and len(n) <= 1), None)
    return {"phases": rows, "samples": samples,
            "second_replica_after_step_s": None if up is None else round(up[0] - step_at, 1),
            "replica_nodes_at_peak": None if up is None else up[1],
            "back_to_one_after_step_end_s": None if down is None else round(down[0] - ends[1], 1)}


def run_autoscale(args) -> dict:
    from specdec_bench.launcher import Service
    from specdec_bench.nodes import placement, running_cluster_app

    app_args = autoscaled(placement(Service(args.config).app_args), args)
    with running_cluster_app(app_args, args.app) as app:
        data = asyncio.run(_run(args, app["url"], app["nodes"]))
    config = {k: v for k, v in vars(args).items() if k not in ("func", "out")}
    return {"machine": machine_facts(1), "config": config, **data}


def autoscale_markdown(data: dict) -> str:
    lines = ["# Autoscaling across nodes", "", f"Config: {data['config']}", "",
             f"- a second plain replica alive {data['second_replica_after_step_s']} s after the step, "
             f"replicas on nodes {data['replica_nodes_at_peak']}",
             f"- back to one replica {data['back_to_one_after_step_end_s']} s after the step ended", "",
             "| phase | concurrency | seconds | requests | lost | tok/s | replicas (median) |",
             "|---|---|---|---|---|---|---|"]
    for r in data["phases"]:
        lines.append(f"| {r['phase']} | {r['concurrency']} | {r['seconds']:.0f} | {r['requests']} | {r['lost']} | "
                     f"{r['tok_s']:.1f} | {r['replicas_median']} |")
    lines += ["", "Samples (s, nodes of the plain replicas): " + ", ".join(f"{s}: {'+'.join(n) or '-'}"
                                                                          for s, n in data["samples"])]
    return "\n".join(lines) + "\n"
