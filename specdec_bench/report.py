"""Tables and plots for benchmark results (regimes.md, *.png)."""

from __future__ import annotations

import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt


def write_json(data: dict, path: Path) -> None:
    path.write_text(json.dumps(data, indent=2) + "\n")


def regimes_markdown(data: dict) -> str:
    m = data["machine"]
    lines = [
        "# Regime benchmark",
        "",
        f"Machine: {m['cpu']}, {m['cores']} cores, torch threads {m['torch_threads']}, torch {m['torch']}, "
        f"load average {m['load_average_1m']:.2f} at start, {m['time']}.",
        f"Config: {json.dumps(data['config'])}",
        "",
        "tok/s = a mode's tokens over the sum of each prompt group's median wall time across reps. "
        "speedup = fixed-K speculative tok/s / plain tok/s; auto/best = the median over reps of auto tok/s over "
        "the better mode's in the same rep (the better of plain and spec by the tok/s above); "
        "predicted = cost model (calibrated step costs + measured acceptance). auto K share: auto's decode "
        "steps at each K (K=1 after plain steps: probes); drift: its engine's measured / calibrated step time "
        "at the cell's batch, plain / speculative relative to plain (1 until both have 20 steps).",
        "",
        "| regime | draft | batch | T | K | plain tok/s | spec tok/s | auto tok/s | speedup | predicted | "
        "auto/best | acceptance | cost ratio | mean acc. len | auto K share | drift | sweep |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for c in data["cells"]:
        lines.append(
            f"| {c['regime']} | {c['draft']} | {c['batch']} | {c['temperature']} | {c['k']} | "
            f"{c['plain_tok_s']:.1f} | {c['spec_tok_s']:.1f} | {c['auto_tok_s']:.1f} | **{c['speedup']:.2f}** | "
            f"{c['predicted_speedup']:.2f} | {c['auto_vs_best']:.2f} | {c['acceptance']:.2f} | "
            f"{c['cost_ratio']:.2f} | {c['mean_acceptance_length']:.2f} | {_k_share(c)} | {_drift(c)} | "
            f"{c.get('sweep') or ''} |"
        )
    return "\n".join(lines) + "\n"


def _k_share(cell: dict) -> str:
    return " ".join(f"{k}:{100 * v:.0f}%" for k, v in (cell.get("auto_k_share") or {}).items())


def _drift(cell: dict) -> str:
    d = cell.get("auto_drift") or {}
    return f"{d['plain']:.2f}/{d['spec']:.2f} ({d['plain_steps']}/{d['spec_steps']})" if d else ""


def plot_regimes(data: dict, out: Path) -> list[Path]:
    cells = data["cells"]
    paths = []
    batch = sorted([c for c in cells if c["draft"] == "draft" and c["temperature"] == 0
                    and c["prompt_set"] == "prose"], key=lambda c: c["batch"])
    if batch:
        fig, ax = plt.subplots(figsize=(6, 4))
        xs = [c["batch"] for c in batch]
        ax.plot(xs, [c["speedup"] for c in batch], "o-", label="fixed K measured")
        ax.plot(xs, [c["predicted_speedup"] for c in batch], "s--", label="fixed K predicted")
        ax.plot(xs, [c["auto_tok_s"] / c["plain_tok_s"] for c in batch], "^-", label="auto measured")
        ax.axhline(1.0, color="gray", lw=1)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("batch size")
        ax.set_ylabel("speedup over plain decoding")
        ax.set_title("Speedup vs batch size (aligned draft, T=0)")
        ax.legend()
        paths.append(_save(fig, out / "speedup_vs_batch.png"))
    temps = sorted([c for c in cells if c["draft"] == "draft" and c["batch"] == 1 and c["prompt_set"] == "prose"],
                   key=lambda c: c["temperature"])
    if temps:
        fig, ax = plt.subplots(figsize=(6, 4))
        xs = [c["temperature"] for c in temps]
        ax.plot(xs, [c["speedup"] for c in temps], "o-", label="fixed K measured")
        ax.plot(xs, [c["predicted_speedup"] for c in temps], "s--", label="fixed K predicted")
        ax.plot(xs, [c["auto_tok_s"] / c["plain_tok_s"] for c in temps], "^-", label="auto measured")
        ax.plot(xs, [c["acceptance"] for c in temps], "x:", label="acceptance a")
        ax.axhline(1.0, color="gray", lw=1)
        ax.set_xlabel("temperature")
        ax.set_ylabel("speedup / acceptance")
        ax.set_title("Speedup vs temperature (aligned draft, batch 1)")
        ax.legend()
        paths.append(_save(fig, out / "speedup_vs_temperature.png"))
    fig, ax = plt.subplots(figsize=(6, 5))
    for c in cells:
        ax.scatter(c["predicted_speedup"], c["speedup"])
        ax.annotate(f"{c['regime']}/{c['draft']}/b{c['batch']}/T{c['temperature']}",
                    (c["predicted_speedup"], c["speedup"]), fontsize=6)
    hi = max([1.6] + [c["speedup"] for c in cells] + [c["predicted_speedup"] for c in cells])
    ax.plot([0, hi], [0, hi], "k--", lw=1)
    ax.plot([0, hi], [0, hi * 1.2], ":", color="gray", lw=1)
    ax.plot([0, hi], [0, hi * 0.8], ":", color="gray", lw=1)
    ax.set_xlabel("predicted speedup")
    ax.set_ylabel("measured speedup")
    ax.set_title("Cost model: predicted vs measured (dotted: ±20%)")
    paths.append(_save(fig, out / "predicted_vs_measured.png"))
    summary = [c for c in cells if not c.get("sweep")]
    fig, ax = plt.subplots(figsize=(8, 4))
    labels = [f"{c['regime']}\n{c['draft']}" for c in summary]
    xs = range(len(summary))
    ax.bar([x - 0.2 for x in xs], [c["speedup"] for c in summary], 0.4, label="fixed K")
    ax.bar([x + 0.2 for x in xs], [c["auto_tok_s"] / c["plain_tok_s"] for c in summary], 0.4, label="auto")
    ax.axhline(1.0, color="gray", lw=1)
    ax.set_xticks(list(xs))
    ax.set_xticklabels(labels, fontsize=7)
    ax.set_ylabel("speedup over plain")
    ax.set_title("Where speculation pays and where it hurts")
    ax.legend()
    paths.append(_save(fig, out / "regimes.png"))
    return paths


def plot_predict(data: dict, out: Path) -> list[Path]:
    paths = []
    for scenario in data["scenarios"]:
        fig, ax = plt.subplots(figsize=(6, 4))
        grid = scenario["speedup"]  # [acceptance][batch]
        im = ax.imshow(grid, origin="lower", aspect="auto", cmap="RdYlGn", vmin=0.5, vmax=2.5)
        ax.set_xticks(range(len(data["batches"])))
        ax.set_xticklabels(data["batches"])
        ax.set_yticks(range(len(data["acceptances"])))
        ax.set_yticklabels(data["acceptances"])
        ax.set_xlabel("batch size")
        ax.set_ylabel("acceptance a")
        ax.set_title(f"{scenario['name']}: best-K speedup", fontsize=9)
        fig.colorbar(im, ax=ax)
        name = scenario["name"].replace(" ", "_").replace("/", "_").replace("+", "")
        paths.append(_save(fig, out / f"predict_{name}.png"))
    return paths


def plot_served_peers(data: dict, out: Path) -> list[Path]:
    """Per family: tok/s against concurrency, one line per server and mode (vLLM dashed)."""
    paths = []
    for fam in data["families"]:
        fig, ax = plt.subplots(figsize=(6, 4))
        for server, mode in dict.fromkeys((r["server"], r["mode"]) for r in fam["summary"]):
            rows = sorted((r for r in fam["summary"] if (r["server"], r["mode"]) == (server, mode)),
                          key=lambda r: r["concurrency"])
            ax.plot([r["concurrency"] for r in rows], [r["tok_s"] for r in rows], marker="o",
                    linestyle="--" if server == "vllm" else "-", label=mode if server == "vllm" else f"this: {mode}")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("concurrency")
        ax.set_ylabel("output tok/s")
        ax.set_title(f"{fam['family']}: this server and vLLM (CPU build)", fontsize=9)
        ax.legend(fontsize=7)
        paths.append(_save(fig, out / f"peers_served_{fam['family']}.png"))
    return paths


def _save(fig, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
