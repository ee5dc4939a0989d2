"""`specdec-bench faults`: a steady mixed load against a running server while a random model replica
is killed (SIGKILL, as a crash) every ``--kill-every`` seconds; ``--warmup`` seconds of load first,
then ``--minutes`` measured.

Each request (closed loop at ``--concurrency``; modes plain / co-located / separate / auto in turn,
greedy and sampled in turn; streamed, ``ignore_eos``) counts as completed only if its stream ends
with ``[DONE]``, carries no error event and holds exactly ``max_tokens`` tokens; anything else is
lost. Reported: requests sent, completed, migrated (the response's ``speculation.migrations``),
lost, latency p50/p99, the kills, and whether every KV slot and session is free once the load
stops. Memory: every replica process's RSS is sampled every ``RSS_EVERY_S`` seconds, and each
process's growth is reported from when it was warm (the measured window's start for the first
processes, ``--warmup`` seconds after it appeared for a replacement, which starts cold) to its last
sample. Replicas are found by process name (``ray::ServeReplica:<app>:<deployment>``) on this
machine, so run one server of that app name at a time.

``--nodes``: instead of a running server, the benchmark starts the config's app on a head and two
worker nodes of this machine (``specdec_bench/nodes.py``: the Target on one worker, the Draft on the
other, a plain replica on each, two routers on the head) and, besides the replica kills, removes a
worker node every ``--node-every`` seconds, each in turn (its raylet, object store and every replica
on it at once), bringing it back ``--node-down`` seconds later with the same resources.
"""

from __future__ import annotations

import asyncio
import os
import random
import signal
import statistics
import subprocess
import threading
import time

import httpx

from specdec_bench import load
from specdec_bench.common import load_prompts, machine_facts

DEPLOYMENTS = ("PlainPool", "ColocatedPool", "Draft", "Target")
MODES = tuple(load.MODES[m] for m in ("plain", "colocated", "separate", "auto"))


def replica_pids(app: str) -> dict[str, int]:
    """Deployment -> pid of its (first) replica process, by process title."""
    out = subprocess.run(["ps", "-eo", "pid,args"], capture_output=True, text=True, check=True).stdout
    pids = {}
    for line in out.splitlines()[1:]:
        pid, _, args = line.strip().partition(" ")
        for name in DEPLOYMENTS:
            if args.strip().startswith(f"ray::ServeReplica:{app}:{name}") and name not in pids:
                pids[name] = int(pid)
    return pids


def rss_mib(pid: int) -> float | None:
    try:
        with open(f"/proc/{pid}/status") as status:
            return next(int(line.split()[1]) / 1024 for line in status if line.startswith("VmRSS:"))
    except (OSError, StopIteration):
        return None


async def one_request(client: httpx.AsyncClient, model: str, prompt: str, i: int, max_tokens: int) -> dict:
    """``load.one_request`` in the fault mix (mode and temperature by turn, seeded), judged whole or lost."""
    extra = {"ignore_eos": True, "seed": i, "temperature": 0.0 if i % 2 == 0 else 0.8}
    args = type("Args", (), {"max_tokens": max_tokens, "temperature": 0.0})
    try:
        r = await load.one_request(client, model, prompt, args, MODES[i % len(MODES)], extra)
    except httpx.HTTPError as exc:
        return {"ok": False, "error": type(exc).__name__}
    ok = "error" not in r and r["done"] and r["stream_error"] is None and r["tokens"] == max_tokens
    why = r.get("error") or r.get("stream_error") or f"{r.get('tokens')} of {max_tokens} tokens, done={r.get('done')}"
    return {"ok": ok, "latency": r.get("latency"), "migrations": r.get("migrations", 0), "error": None if ok else why}


RSS_EVERY_S = 15.0


async def _run(args, window: float | None = None) -> dict:
    """The load and the replica kills; the measured window starts at ``window`` (monotonic), by
    default ``--warmup`` seconds from now."""
    prompts = load_prompts(args.prompts)
    rng = random.Random(args.seed)
    results, kills = [], []
    samples: dict[int, list[tuple[float, str, float]]] = {}  # pid -> [(s since the window's start, deployment, MiB)]
    async with httpx.AsyncClient(base_url=args.url, timeout=300) as client:
        model = (await client.get("/v1/models")).json()["data"][0]["id"]
        window = window or time.monotonic() + args.warmup  # the measured window's start
        stop_at = window + 60 * args.minutes
        counter = iter(range(10**9))

        async def worker():
            while time.monotonic() < stop_at:
                i = next(counter)
                results.append(await one_request(client, model, prompts[i % len(prompts)], i, args.max_tokens))

        async def sampler():
            while time.monotonic() < stop_at:
                t = time.monotonic() - window
                for name, pid in replica_pids(args.app).items():
                    mib = rss_mib(pid)
                    if mib is not None:
                        samples.setdefault(pid, []).append((t, name, mib))
                await asyncio.sleep(RSS_EVERY_S)

        async def killer():
            next_kill = window + args.kill_every / 2
            while next_kill < stop_at - args.kill_every / 4:
                await asyncio.sleep(max(0.0, next_kill - time.monotonic()))
                next_kill += args.kill_every
                pids = replica_pids(args.app)
                if not pids:  # all restarting: try again at the next turn
                    continue
                name = rng.choice(sorted(pids))
                try:
                    os.kill(pids[name], signal.SIGKILL)
                except ProcessLookupError:
                    continue
                kills.append({"t_s": round(time.monotonic() - window, 1), "deployment": name})
                print(f"killed {name} (pid {pids[name]})", flush=True)

        await asyncio.gather(sampler(), killer(), *[worker() for _ in range(args.concurrency)])
        await asyncio.sleep(2.0)  # releases of the last requests
        stats = (await client.get("/v1/stats")).json()
    ok = [r for r in results if r["ok"]]
    lat = sorted(r["latency"] for r in ok)
    replicas = [r for pool in ("plain", "colocated", "draft", "target") for r in stats.get(pool, [])]
    return {
        "machine": machine_facts(1), "config": {k: v for k, v in vars(args).items() if k != "func" and k != "out"},
        "sent": len(results), "completed": len(ok), "lost": len(results) - len(ok),
        "migrated": sum(1 for r in ok if r["migrations"]),
        "lost_errors": [r["error"] for r in results if not r["ok"]][:20],
        "latency_s": {"p50": statistics.median(lat) if lat else None,
                      "p99": lat[min(len(lat) - 1, int(0.99 * len(lat)))] if lat else None},
        "kills": kills,
        "rss": rss_growth(samples, args.warmup),
        "kv_free_at_end": all(r.get("free_slots") == r.get("total_slots") and not r.get("sessions") for r in replicas),
    }


def rss_growth(samples: dict[int, list[tuple[float, str, float]]], warmup_s: float) -> list[dict]:
    """Per replica process: its RSS once warm and at its last sample (None warm: it died or the window
    ended before it was warm). A process seen before the window is warm at the window's start; a
    replacement ``warmup_s`` after it first appeared."""
    rows = []
    for pid, seen in samples.items():
        warm_from = 0.0 if seen[0][0] <= 0 else seen[0][0] + warmup_s
        warm = next(((t, mib) for t, _, mib in seen if t >= warm_from), None)
        end_t, name, end = seen[-1]
        rows.append({"deployment": name, "pid": pid, "first_seen_s": round(seen[0][0], 1),
                     "warm_at_s": None if warm is None else round(warm[0], 1),
                     "warm_mib": None if warm is None else warm[1],
                     "end_at_s": round(end_t, 1), "end_mib": end,
                     "growth_pct": None if warm is None else 100 * (end / warm[1] - 1)})
    return sorted(rows, key=lambda r: (r["deployment"], r["first_seen_s"]))


def placement_now(app: str, nodes) -> dict[str, list[str]]:
    """Deployment -> the node names its live replicas are on."""
    from specdec_bench.nodes import replica_nodes

    return {d: sorted(nodes.name_of(n) for n in replica_nodes(app, d)) for d in ("Router", *DEPLOYMENTS)}


def run_faults(args) -> dict:
    if not args.nodes:
        return asyncio.run(_run(args))
    from specdec_bench.launcher import Service
    from specdec_bench.nodes import placement, running_cluster_app

    with running_cluster_app(placement(Service(args.config).app_args), args.app) as app:
        args.url = app["url"]
        window = time.monotonic() + args.warmup + 5  # the load's client starts within 5 s
        out: dict = {}

        def load():
            try:
                out["data"] = asyncio.run(_run(args, window))
            except BaseException as exc:  # noqa: B036 - re-raised in the main thread
                out["error"] = exc

        # Ray adds nodes from the main thread only (it installs signal handlers): the load runs beside it
        thread = threading.Thread(target=load, name="faults-load")
        thread.start()
        losses = lose_nodes(app["nodes"], args, window)
        thread.join()
        if "error" in out:
            raise out["error"]
        return {**out["data"], "node_losses": losses, "placement": placement_now(args.app, app["nodes"])}


def lose_nodes(nodes, args, window: float) -> list[dict]:
    """Every ``--node-every`` s of the window, a worker node removed (each in turn, from one the seed
    picks) and ``--node-down`` s later added back with the same resources (off the beat of the
    replica kills)."""
    names = sorted(nodes.workers)
    turn = random.Random(args.seed).randrange(len(names))
    stop_at = window + 60 * args.minutes
    losses, next_loss = [], window + args.node_every / 2 + args.kill_every / 4
    while next_loss < stop_at - args.node_down:
        time.sleep(max(0.0, next_loss - time.monotonic()))
        next_loss += args.node_every
        name, turn = names[turn % len(names)], turn + 1
        t = time.monotonic() - window
        nodes.remove(name)
        print(f"removed node {name}", flush=True)
        time.sleep(args.node_down)
        nodes.add(name)
        print(f"node {name} back", flush=True)
        losses.append({"t_s": round(t, 1), "node": name, "back_s": round(time.monotonic() - window, 1)})
    return losses


def faults_markdown(data: dict) -> str:
    kills = ", ".join(f"{k['deployment']} at {k['t_s']} s" for k in data["kills"])
    lines = ["# Fault benchmark", "", f"Config: {data['config']}", "",
             (f"- sent {data['sent']}, completed {data['completed']}, migrated {data['migrated']}, "
              f"lost {data['lost']}"),
             f"- latency p50 {data['latency_s']['p50'] or 0:.2f} s, p99 {data['latency_s']['p99'] or 0:.2f} s",
             f"- kills (s into the measured window): {kills}",
             *(["- nodes removed (s into the measured window): " + ", ".join(
                 f"{n['node']} at {n['t_s']} s (back {n['back_s']} s)" for n in data["node_losses"])]
               if data.get("node_losses") else []),
             *([f"- placement at the end: {data['placement']}"] if data.get("placement") else []),
             f"- every KV slot and session free at the end: {data['kv_free_at_end']}", "",
             "| deployment | pid | first seen (s) | warm at (s) | RSS warm (MiB) | last sample (s) "
             "| RSS then (MiB) | growth |",
             "|---|---|---|---|---|---|---|---|"]
    for r in data["rss"]:
        warm = "- | -" if r["warm_mib"] is None else f"{r['warm_at_s']:.0f} | {r['warm_mib']:.0f}"
        growth = "-" if r["growth_pct"] is None else f"{r['growth_pct']:+.1f}%"
        lines.append(f"| {r['deployment']} | {r['pid']} | {r['first_seen_s']:.0f} | {warm} | {r['end_at_s']:.0f} | "
                     f"{r['end_mib']:.0f} | {growth} |")
    if data["lost_errors"]:
        lines += ["", "Lost: " + "; ".join(map(str, data["lost_errors"]))]
    return "\n".join(lines) + "\n"
