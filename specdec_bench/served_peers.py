"""`specdec-bench peers --served`: this project's server and vLLM's CPU build on the same models, the
same load, this machine (issue 37).

One server at a time, each started by the benchmark on a free 127.0.0.1 port and stopped after its
passes: vLLM (its own venv, ``specdec_bench/vllm_env.py``; an API key, as everything that listens
here has one) once per mode (plain, its draft-model speculation, its n-gram speculation; K=4, and
``--no-async-scheduling``: with async scheduling on it starved on 2 vCPUs), then this project's
``./run serve`` on a config whose models are the family's, once for all its modes (plain,
co-located, separate, auto). Every pass is the same client: ``load.run_pass``, a closed loop at each
concurrency, 48-token greedy prose streamed with ``ignore_eos`` (vLLM's extension as well), and
TTFT, TPOT and tok/s as ``vllm bench serve`` names them. ``--repeats`` runs the whole order again
(this project's modes rotated); the tables are medians over repeats, with the spread. The greedy
text of both servers' plain mode is compared once per family.

vLLM's streamed TTFT is unreliable on 2 vCPUs (its chunks coalesce under CPU starvation): compare
throughput and end-to-end latency.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import secrets
import signal
import statistics
import subprocess
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

import httpx
import yaml

from specdec_bench import load, vllm_env
from specdec_bench.common import machine_facts
from specdec_bench.local_app import free_port

ROOT = Path(__file__).resolve().parent.parent
FAMILIES = {"dram": ("models/dram/target", "models/dram/draft"), "tiny": ("models/target", "models/draft")}
K = 4
# mode -> (its --speculative-config from the draft's path, or None; further server flags)
VLLM_MODES = {
    "vllm-plain": (None, ()),
    "vllm-draft": (lambda draft: {"method": "draft_model", "model": draft, "num_speculative_tokens": K}, ()),
    "vllm-ngram": (lambda draft: {"method": "ngram", "num_speculative_tokens": K, "prompt_lookup_max": 4,
                                  "prompt_lookup_min": 2}, ()),
    # Ablation: what vLLM's automatic prefix caching (on by default) buys it on this load.
    "vllm-plain-no-prefix-cache": (None, ("--no-enable-prefix-caching",)),
}
DEFAULT_VLLM_MODES = ("vllm-plain", "vllm-draft", "vllm-ngram")
OUR_MODES = ("plain", "colocated", "separate", "auto")
# this project's server -> its config's changes to serve_config.yaml's args
OUR_SERVERS = {"specdec": {}, "specdec-no-prefix-cache": {"prefix_cache_tokens": 0}}
ABLATION = "-no-prefix-cache"  # a server or mode so named is never "the best" of its side
READY_TIMEOUT_S = 600
MODEL = "specdec"


def _wait_ready(url: str, headers: dict, proc: subprocess.Popen, log: Path) -> float:
    """Seconds until ``url`` answers a completion (this project's answers 503 until all of it runs)."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < READY_TIMEOUT_S:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited ({proc.returncode}) before it answered; its log: {log}")
        with contextlib.suppress(httpx.HTTPError):
            r = httpx.post(f"{url}/v1/completions", headers=headers, timeout=30,
                           json={"model": MODEL, "prompt": "Hello", "max_tokens": 2})
            if r.status_code == 200:
                return time.monotonic() - t0
        time.sleep(2.0)
    raise RuntimeError(f"no answer from {url} within {READY_TIMEOUT_S} s; its log: {log}")


def _stop(proc: subprocess.Popen) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


@contextlib.contextmanager
def vllm_server(py: Path, target: str, draft: str, mode: str, logs: Path):
    """vLLM's OpenAI server on ``target`` in ``mode``: {"url", "api_key", "ready_s"}."""
    port, key = free_port(), secrets.token_hex(16)
    cmd = [str(py), "-m", "vllm.entrypoints.openai.api_server", "--model", str(ROOT / target),
           "--served-model-name", MODEL, "--host", "127.0.0.1", "--port", str(port), "--dtype", "float32",
           "--max-model-len", "512", "--no-async-scheduling", "--api-key", key]
    spec, flags = VLLM_MODES[mode]
    if spec is not None:
        cmd += ["--speculative-config", json.dumps(spec(str(ROOT / draft)))]
    cmd += flags
    log = logs / f"{mode}.log"
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=vllm_env.runtime_env(),
                                start_new_session=True, cwd=ROOT)
    try:
        url = f"http://127.0.0.1:{port}"
        ready = _wait_ready(url, {"Authorization": f"Bearer {key}"}, proc, log)
        yield {"url": url, "api_key": key, "ready_s": ready}
    finally:
        _stop(proc)


def family_config(target: str, draft: str, port: int, out: Path, changes: dict | None = None) -> Path:
    """serve_config.yaml with the family's models, another port and ``changes`` to its args."""
    cfg = yaml.safe_load((ROOT / "serve_config.yaml").read_text())
    cfg["http_options"]["port"] = port
    cfg["applications"][0]["args"].update(target=target, draft=draft, model_name=MODEL, **(changes or {}))
    path = out / "serve_config.yaml"
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    return path


@contextlib.contextmanager
def our_server(target: str, draft: str, logs: Path, changes: dict | None = None, name: str = "specdec"):
    """``./run serve`` of the default config on the family's models: {"url", "api_key", "ready_s"}."""
    port = free_port()
    config = family_config(target, draft, port, logs, changes)
    log = logs / f"{name}.log"
    with open(log, "w") as out:
        proc = subprocess.Popen(["bash", str(ROOT / "run"), "serve", str(config)], stdout=out,
                                stderr=subprocess.STDOUT, start_new_session=True, cwd=ROOT)
    try:
        url = f"http://127.0.0.1:{port}"
        ready = _wait_ready(url, {}, proc, log)
        yield {"url": url, "api_key": None, "ready_s": ready}
    finally:
        _stop(proc)


def _pass(server: dict, args, speculation, concurrency: int) -> dict:
    cli = SimpleNamespace(url=server["url"], api_key=server["api_key"], concurrency=concurrency,
                          requests=max(args.requests, 2 * concurrency), max_tokens=args.max_tokens,
                          temperature=0.0, prompts=args.prompts, user=None, reuse_prompts=args.reuse_prompts)
    return asyncio.run(load.run_pass(cli, MODEL, speculation, None))


def _greedy_text(server: dict, speculation) -> str:
    body = {"model": MODEL, "prompt": "It is a truth universally acknowledged", "max_tokens": 48,
            "temperature": 0, "ignore_eos": True}
    if speculation is not None:
        body["speculation"] = speculation
    headers = load.auth_headers(SimpleNamespace(api_key=server["api_key"]))
    return httpx.post(f"{server['url']}/v1/completions", json=body, headers=headers, timeout=120).json()[
        "choices"][0]["text"]


def _keep(res: dict) -> dict:
    return {k: res[k] for k in ("output_throughput", "median_ttft_ms", "median_tpot_ms", "p99_tpot_ms",
                                "median_e2el_ms", "p99_e2el_ms", "acceptance_rate", "errors", "completed")}


def run_family(name: str, args, py: Path, logs: Path) -> dict:
    target, draft = FAMILIES[name]
    passes, texts, starts = [], {}, {}
    for rep in range(args.repeats):
        for mode in args.vllm_modes:
            print(f"[peers] {name}: vLLM {mode} (repeat {rep + 1})", flush=True)
            with vllm_server(py, target, draft, mode, logs) as server:
                starts.setdefault(mode, []).append(server["ready_s"])
                if mode == "vllm-plain" and rep == 0:
                    texts["vllm"] = _greedy_text(server, None)
                for c in args.concurrency:
                    passes.append({"server": "vllm", "mode": mode, "concurrency": c, "repeat": rep,
                                   **_keep(_pass(server, args, None, c))})
        for ours in args.ours:
            print(f"[peers] {name}: this project, {ours} (repeat {rep + 1})", flush=True)
            with our_server(target, draft, logs, OUR_SERVERS[ours], ours) as server:
                starts.setdefault(ours, []).append(server["ready_s"])
                if "specdec" not in texts:
                    texts["specdec"] = _greedy_text(server, load.MODES["plain"])
                modes = tuple(args.our_modes)
                order = modes[rep % len(modes):] + modes[:rep % len(modes)]
                for c in args.concurrency:
                    for mode in order:
                        passes.append({"server": ours, "mode": mode, "concurrency": c, "repeat": rep,
                                       **_keep(_pass(server, args, load.MODES[mode], c))})
    return {"family": name, "target": target, "draft": draft, "passes": passes, "cold_start_s": starts,
            # None: vllm-plain or this project's server did not run, so nothing was compared
            "greedy_identical": texts["vllm"] == texts["specdec"] if len(texts) == 2 else None,
            "greedy_texts": texts,
            "summary": summarise(passes)}


def summarise(passes: list[dict]) -> list[dict]:
    """Per (mode, concurrency): the median tok/s over repeats, its spread, and the medians of the rest."""
    rows = []
    for key in dict.fromkeys((p["server"], p["mode"], p["concurrency"]) for p in passes):
        got = [p for p in passes if (p["server"], p["mode"], p["concurrency"]) == key]
        tput = [p["output_throughput"] for p in got]
        rows.append({"server": key[0], "mode": key[1], "concurrency": key[2], "tok_s": statistics.median(tput),
                     "tok_s_min": min(tput), "tok_s_max": max(tput), "repeats": len(got),
                     **{f: statistics.median(p[f] for p in got) for f in
                        ("median_ttft_ms", "median_tpot_ms", "p99_tpot_ms", "median_e2el_ms", "p99_e2el_ms",
                         "acceptance_rate")},
                     "errors": sum(p["errors"] for p in got)})
    for c in {r["concurrency"] for r in rows}:
        at = [r for r in rows if r["concurrency"] == c]
        vllm_best = max((r["tok_s"] for r in at if r["server"] == "vllm" and ABLATION not in r["mode"]),
                        default=0.0)
        for r in at:
            r["vs_vllm_best"] = r["tok_s"] / vllm_best if vllm_best else None
    return rows


def run_served_peers(args) -> dict:
    py = vllm_env.ensure()
    logs = Path(tempfile.mkdtemp(prefix="specdec-peers-"))
    families = [run_family(name, args, py, logs) for name in args.families]
    config = {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items() if k != "func"}
    return {"machine": machine_facts(1), "config": config, "logs": str(logs), "families": families}


def served_peers_markdown(data: dict) -> str:
    lines = ["# Served peers: this project and vLLM (CPU build)", "", f"Config: {data['config']}", ""]
    for fam in data["families"]:
        concurrencies = sorted({r["concurrency"] for r in fam["summary"]})
        lines += [f"## {fam['family']} ({fam['target']}, draft {fam['draft']})", "",
                  f"Greedy text identical (plain, 48 tokens): {fam['greedy_identical']}; cold starts (s): "
                  + ", ".join(f"{m} {statistics.median(v):.0f}" for m, v in fam["cold_start_s"].items()), "",
                  "tok/s, median over repeats (min-max); x = of vLLM's best mode at that concurrency", "",
                  "| server | mode | " + " | ".join(f"c={c}" for c in concurrencies) + " |",
                  "|---|---|" + "---|" * len(concurrencies)]
        for key in dict.fromkeys((r["server"], r["mode"]) for r in fam["summary"]):
            cells = []
            for c in concurrencies:
                r = next(x for x in fam["summary"] if (x["server"], x["mode"], x["concurrency"]) == (*key, c))
                spread = f" ({r['tok_s_min']:.0f}-{r['tok_s_max']:.0f})" if r["repeats"] > 1 else ""
                cells.append(f"{r['tok_s']:.0f}{spread} x{r['vs_vllm_best']:.2f}"
                             + (f", {r['errors']} errors" if r["errors"] else ""))
            lines.append(f"| {key[0]} | {key[1]} | " + " | ".join(cells) + " |")
        lines += ["", "| server | mode | concurrency | TPOT p50 / p99 ms | E2E p50 / p99 ms | acceptance |",
                  "|---|---|---|---|---|---|"]
        for r in fam["summary"]:
            lines.append(f"| {r['server']} | {r['mode']} | {r['concurrency']} | {r['median_tpot_ms']:.1f} / "
                         f"{r['p99_tpot_ms']:.1f} | {r['median_e2el_ms']:.0f} / {r['p99_e2el_ms']:.0f} | "
                         f"{r['acceptance_rate']:.2f} |")
        lines.append("")
    return "\n".join(lines) + "\n"
