"""Shared benchmark plumbing: machine facts, prompt sets, timing statistics, engine construction."""

from __future__ import annotations

import json
import os
import platform
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

import torch

# The served family by default (serve_config.yaml: its target streams its weights from DRAM, as a GPU's from
# HBM); `--models models/dram` runs the same function ~5x faster where a host's cache holds that target
# (models/dram-wide/README.md); the tiny family (models/, the test fixtures) with SPECDEC_MODELS=models.
MODELS_DIR = Path(os.environ.get("SPECDEC_MODELS", Path(__file__).resolve().parent.parent / "models" / "dram-wide"))


def machine_facts(threads: int) -> dict:
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "torch_threads": threads,
        "torch": torch.__version__,
        "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        "load_average_1m": os.getloadavg()[0],
        "python": platform.python_version(),
        "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }


def load_prompts(name: str, limit: int | None = None, models_dir: Path = MODELS_DIR) -> list[str]:
    """Prompt set ``name`` (prose, code, repetitive, long) shipped under models/prompts."""
    path = Path(models_dir) / "prompts" / f"{name}.jsonl"
    prompts = [json.loads(line)["prompt"] for line in path.read_text().splitlines() if line.strip()]
    return prompts[:limit] if limit else prompts


@dataclass
class Summary:
    median: float
    p10: float
    p90: float
    runs: int

    @classmethod
    def of(cls, values: list[float]) -> Summary:
        ordered = sorted(values)
        pick = lambda f: ordered[min(len(ordered) - 1, int(f * len(ordered)))]
        return cls(statistics.median(ordered), pick(0.1), pick(0.9), len(ordered))

    def as_dict(self) -> dict:
        return {"median": self.median, "p10": self.p10, "p90": self.p90, "runs": self.runs}


def judged_acceptance(outs) -> float:
    """Per-token acceptance a over a run: accepted / judged positions (unbiased; see acceptance.py)."""
    accepted = sum(o.stats.accepted for o in outs)
    judged = sum(sum(o.stats.proposed_per_position) for o in outs)
    return accepted / judged if judged else 0.0
