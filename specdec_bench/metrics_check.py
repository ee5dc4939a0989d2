"""`specdec-bench metrics`: a real Prometheus against a running service, checked as an operator would.

Starts Prometheus (Debian's ``prometheus`` package, or ``--prometheus PATH``) with the shipped
scrape config (``deploy/prometheus/prometheus.yml``: Ray's service discovery file), sends mixed
traffic (plain, co-located, separate and auto; greedy and T=1) for ``--seconds``, then:

- evaluates every PromQL expression of the shipped Grafana dashboard
  (``deploy/grafana/specdec-serve.json``): each must return at least one series;
- compares what Prometheus counted during the traffic (each counter's total after it less its total
  before: the emitted, proposed and accepted tokens and the requests) with the sums of the responses' own
  ``usage`` and ``speculation`` objects: they must agree within 1%.
"""

from __future__ import annotations

import asyncio
import json
import shutil
import subprocess
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

import httpx

from specdec_bench.common import load_prompts, machine_facts
from specdec_bench.load import MODES, one_request
from specdec_bench.local_app import free_port

ROOT = Path(__file__).resolve().parent.parent
COUNTERS = {  # Prometheus counter -> the response field summed for it
    "ray_specdec_output_tokens_total": "tokens",
    "ray_specdec_proposed_tokens_total": "proposed",
    "ray_specdec_accepted_tokens_total": "accepted",
    "ray_specdec_requests_total": "requests",
}


def dashboard_queries(path: Path) -> list[tuple[str, str]]:
    """(panel title, PromQL) for every target of every panel."""
    dash = json.loads(path.read_text())
    return [(p["title"], t["expr"]) for p in dash["panels"] for t in p.get("targets", [])]


class Prometheus:
    """A Prometheus server of its own (temporary storage, 127.0.0.1, a free port)."""

    def __init__(self, binary: str, config: Path, ray_temp: str):
        self.dir = Path(tempfile.mkdtemp(prefix="specdec-prom-"))
        text = config.read_text().replace("/tmp/ray/", f"{ray_temp.rstrip('/')}/")
        (self.dir / "prometheus.yml").write_text(text)
        self.url = f"http://127.0.0.1:{free_port()}"
        self.proc = subprocess.Popen(
            [binary, f"--config.file={self.dir / 'prometheus.yml'}", f"--storage.tsdb.path={self.dir / 'data'}",
             f"--web.listen-address={self.url.removeprefix('http://')}"],
            stdout=subprocess.DEVNULL, stderr=open(self.dir / "prometheus.log", "w"))

    def wait_ready(self, timeout_s: float = 60) -> None:
        deadline = time.time() + timeout_s
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"prometheus exited: {(self.dir / 'prometheus.log').read_text()[-2000:]}")
            try:
                if httpx.get(f"{self.url}/-/ready", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise RuntimeError("prometheus did not become ready")

    def query(self, expr: str, at: float | None = None) -> list[dict]:
        params = {"query": expr, **({"time": at} if at is not None else {})}
        r = httpx.get(f"{self.url}/api/v1/query", params=params, timeout=30)
        r.raise_for_status()
        return r.json()["data"]["result"]

    def total(self, metric: str, at: float | None = None) -> float:
        return sum(float(s["value"][1]) for s in self.query(f"sum({metric})", at))

    def targets_up(self) -> int:
        return int(self.total("up"))

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(timeout=30)
        shutil.rmtree(self.dir, ignore_errors=True)


async def mixed_traffic(args, model: str, seconds: float) -> list[dict]:
    """Closed loop, ``args.concurrency`` clients, each request's mode and temperature in turn."""
    prompts = load_prompts(args.prompts, None)
    kinds = [(mode, t) for mode in ("plain", "colocated", "separate", "auto") for t in (0.0, 1.0)]
    results, deadline, counter = [], time.time() + seconds, iter(range(10**9))
    async with httpx.AsyncClient(base_url=args.url, timeout=120) as client:

        async def worker():
            while time.time() < deadline:
                i = next(counter)
                mode, temperature = kinds[i % len(kinds)]
                req_args = SimpleNamespace(max_tokens=args.max_tokens, temperature=temperature,
                                           user=f"metrics-{i % 3}")
                r = await one_request(client, model, prompts[i % len(prompts)], req_args, MODES[mode])
                results.append({**r, "mode": mode, "temperature": temperature})

        await asyncio.gather(*(worker() for _ in range(args.concurrency)))
    return results


def _wait_counted(prom: Prometheus, want_requests: float, before: float, timeout_s: float) -> None:
    """Until Prometheus has scraped the request counter of every request sent (Ray's agent exports
    every few seconds), then one more scrape, so that every counter of that export is in."""
    deadline = time.time() + timeout_s
    while prom.total("ray_specdec_requests_total") - before < want_requests and time.time() < deadline:
        time.sleep(2)
    time.sleep(6)


def run_metrics_check(args) -> dict:
    model = args.model or httpx.get(f"{args.url}/v1/models", timeout=30).json()["data"][0]["id"]
    prom = Prometheus(args.prometheus, Path(args.config), args.ray_temp)
    try:
        prom.wait_ready()
        deadline = time.time() + 60
        while prom.targets_up() == 0:  # the first scrape of Ray's metrics agent
            if time.time() > deadline:
                raise RuntimeError("prometheus found no Ray metrics target (service discovery file?)")
            time.sleep(1)
        time.sleep(12)  # two scrapes and an export interval: a settled baseline
        t_before = time.time()
        before = {m: prom.total(m, t_before) for m in COUNTERS}
        results = asyncio.run(mixed_traffic(args, model, args.seconds))
        ok = [r for r in results if "error" not in r and not r.get("stream_error")]
        sent = {"tokens": sum(r["tokens"] for r in ok), "proposed": sum(r["proposed"] for r in ok),
                "accepted": sum(r["accepted"] for r in ok), "requests": len(ok)}
        _wait_counted(prom, sent["requests"], before["ray_specdec_requests_total"], 90)
        t_after = time.time()
        counted = {m: prom.total(m, t_after) - before[m] for m in COUNTERS}
        agreement = {}
        for metric, field in COUNTERS.items():
            want, got = sent[field], counted[metric]
            agreement[metric] = {"responses": want, "prometheus": got,
                                 "relative_error": abs(got - want) / want if want else float(got != 0)}
        panels = []
        for title, expr in dashboard_queries(Path(args.dashboard)):
            series = prom.query(expr, t_after)
            panels.append({"panel": title, "expr": expr, "series": len(series)})
    finally:
        prom.stop()
    return {"machine": machine_facts(0), "seconds": args.seconds, "concurrency": args.concurrency,
            "requests": len(results), "failed": len(results) - len(ok), "counters": agreement, "panels": panels,
            "passed": (all(a["relative_error"] <= 0.01 for a in agreement.values())
                       and all(p["series"] > 0 for p in panels) and len(ok) == len(results))}


def metrics_markdown(data: dict) -> str:
    lines = ["# Metrics on a real Prometheus", "",
             f"{data['requests']} requests of mixed traffic in {data['seconds']:.0f} s at concurrency "
             f"{data['concurrency']} ({data['failed']} failed); passed: {data['passed']}.", "",
             "| counter | from the responses | Prometheus (growth over the traffic) | relative error |",
             "|---|---|---|---|"]
    for metric, a in data["counters"].items():
        lines.append(f"| `{metric}` | {a['responses']:.0f} | {a['prometheus']:.0f} | {a['relative_error']:.4f} |")
    lines += ["", "| dashboard panel | series |", "|---|---|"]
    lines += [f"| {p['panel']} (`{p['expr'][:60]}...`) | {p['series']} |" for p in data["panels"]]
    return "\n".join(lines) + "\n"
