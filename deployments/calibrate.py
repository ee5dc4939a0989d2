"""Calibration files: measured step costs of one target/draft pair on one device.

    specdec-calibrate --target models/target --draft models/draft --out calibration.json

times the pair through the engine's own step phases (``specdec_core.calibration.calibrate``:
t_T(b, q) for b in --batches, q = K+1 in --qs, and t_D(b)) and writes a JSON record

    {"target": path, "draft": path (relative to the project root when inside it),
     "device": "cpu" | "cuda", "created": unix time, "torch_threads": n, "costs": StepCosts.to_dict()}

A file holds one record or ``{"calibrations": [record, ...]}`` (a new run replaces the record of
the same pair and device). ``EngineReplica`` loads it through the config key ``calibration_file``
when target, draft and device match, instead of calibrating at start-up.

Without a file, a replica that calibrates at start-up keeps the result in a per-host cache
(``calibration_cache``; ``~/.cache/specdec-serve/``, or ``SPECDEC_CALIBRATION_CACHE``), keyed by
everything the costs depend on: both models' weight files (path, size, mtime), device, dtype,
torch threads and version, the grid, the host (name, CPU model, cores) and the engine code a step
runs (``STEP_CODE``: a faster attention makes old costs wrong). A restart on the same
host with the same models loads it; anything else calibrates again. The same folder keeps the
host's kernel bands (``measuring_alone``): which matmul kernel each projection shape runs at which row
count, probed by the host's first replica and run by every engine after it.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import hashlib
import json
import logging
import os
import platform
import time
from pathlib import Path

from specdec_core import linear
from specdec_core.step_costs import StepCosts

logger = logging.getLogger("ray.serve")

DEFAULT_BATCHES = (1, 2, 4, 8, 16, 32)
DEFAULT_QS = (1, 2, 3, 5, 9)


def device_kind(device) -> str:
    return str(getattr(device, "type", device) or "cpu").split(":")[0]


def _key(target: str, draft: str | None, device: str) -> tuple:
    from deployments.config import resolve_model_path

    return (resolve_model_path(target), resolve_model_path(draft) if draft else None, device_kind(device))


def _portable(path: str | None) -> str | None:
    """Paths inside the project are stored relative to its root, so a shipped file matches in any clone."""
    root = Path(__file__).resolve().parent.parent
    if path and Path(path).is_absolute() and Path(path).resolve().is_relative_to(root):
        return str(Path(path).resolve().relative_to(root))
    return path


def record(costs: StepCosts, target: str, draft: str | None, device: str, **meta) -> dict:
    t, d, dev = _key(target, draft, device)
    return {"target": _portable(t), "draft": _portable(d), "device": dev, "created": time.time(), **meta,
            "costs": costs.to_dict()}


def _records(path: str | os.PathLike) -> list[dict]:
    data = json.loads(Path(path).read_text())
    return data["calibrations"] if isinstance(data, dict) and "calibrations" in data else [data]


def load_calibration(path: str | os.PathLike, target: str, draft: str | None, device) -> StepCosts | None:
    """The costs recorded for this pair and device, or None (missing file, or no matching record)."""
    if not Path(path).exists():
        logger.warning("calibration file %s does not exist", path)
        return None
    want = _key(target, draft, device)
    for rec in _records(path):
        if _key(rec["target"], rec.get("draft"), rec.get("device", "cpu")) == want:
            return StepCosts.from_dict(rec["costs"])
    logger.warning("calibration file %s has no record for target=%s draft=%s device=%s", path, *want)
    return None


def save_calibration(path: str | os.PathLike, rec: dict) -> None:
    """Write ``rec``, replacing a record of the same pair and device already in the file."""
    keep = []
    if Path(path).exists():
        mine = _key(rec["target"], rec.get("draft"), rec["device"])
        keep = [r for r in _records(path) if _key(r["target"], r.get("draft"), r.get("device", "cpu")) != mine]
    out = rec if not keep else {"calibrations": keep + [rec]}
    Path(path).write_text(json.dumps(out, indent=1) + "\n")


CACHE_DIR = Path(os.environ.get("SPECDEC_CALIBRATION_CACHE", Path.home() / ".cache" / "specdec-serve"))


@contextlib.contextmanager
def measuring_alone():
    """Held while a replica builds its models (their kernel probes, ``linear.packed_rows``) and calibrates:
    one replica on this host at a time (an exclusive ``flock`` on a file in ``CACHE_DIR``, released when the
    holder exits, even killed). Why: a serve start builds four engines at once on 2 cores, each probe timing
    528 MB of weights beside the others'; one start's plain engine took the packed kernel for qkv at 2 rows
    only and gate_up at 4 (the co-located engine beside it: 2-16 and 8-16), and its batch-8 steps ran
    75 ms where the in-process engine's ran 56 (BENCHMARKS.md, "Closed-loop rounds").

    Inside, the models adopt the kernel bands the host's earlier replicas probed (``host_bands``), and the
    bands probed here are kept for the next: probed one at a time, engines still chose differently (the
    plain engine packed ``down`` at 2 rows, the co-located one at 4-16), since a near tie flips with the
    moment; kept, every engine on the host runs the kernels its cached calibration measured."""
    CACHE_DIR.mkdir(parents=True, exist_ok=True)
    with open(CACHE_DIR / "measuring.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            known = host_bands()
            linear.adopt_bands(known)
            yield
            if linear.probed_bands().keys() - known.keys():
                _store_bands({**known, **linear.probed_bands()})
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def _bands_path() -> Path:
    """The host's kernel bands: per host, torch and kernel code (``linear.py``)."""
    import torch

    code = Path(linear.__file__).read_bytes()
    parts = [_host(), torch.__version__, hashlib.sha256(code).hexdigest()[:16]]
    return CACHE_DIR / f"kernel-bands-{hashlib.sha256(json.dumps(parts).encode()).hexdigest()[:32]}.json"


def host_bands() -> dict[str, list[int] | None]:
    """The kernel bands the replicas on this host probed (``linear.probed_bands``), by shape; {} if none."""
    try:
        return json.loads(_bands_path().read_text())
    except (OSError, ValueError):
        return {}


def _store_bands(bands: dict[str, list[int] | None]) -> None:
    try:
        tmp = CACHE_DIR / f".kernel-bands.{os.getpid()}.tmp"
        tmp.write_text(json.dumps(bands, indent=1, sort_keys=True))
        tmp.replace(_bands_path())
    except OSError:
        logger.warning("could not keep the kernel bands in %s", CACHE_DIR, exc_info=True)


def _weights(path: str | None) -> list:
    """(name, size, mtime) of a local model's weight files: retrained weights at the same path are new."""
    if path is None or not Path(path).is_dir():
        return [path]
    return [(f.name, f.stat().st_size, int(f.stat().st_mtime))
            for f in sorted(Path(path).resolve().glob("*.safetensors"))]


def _host() -> list:
    try:
        cpu = next((ln.split(":", 1)[1].strip() for ln in Path("/proc/cpuinfo").read_text().splitlines()
                    if ln.startswith("model name")), "")
    except OSError:
        cpu = platform.processor()
    return [platform.node(), cpu, os.cpu_count()]


# The code a step's time depends on: a change there (a kernel, the attention) makes cached costs stale.
STEP_CODE = ("fused_llama.py", "linear.py", "runner.py", "kv_cache.py", "verifier.py", "sampling.py", "calibration.py")


def _step_code() -> str:
    core = Path(__file__).resolve().parent.parent / "specdec_core"
    return hashlib.sha256(b"".join((core / name).read_bytes() for name in STEP_CODE)).hexdigest()[:16]


def cache_key(target: str, draft: str | None, device, dtype, **grid) -> str:
    """The start-up calibration's cache key on this host (module docstring)."""
    import torch

    t, d, dev = _key(target, draft, device)
    parts = [t, _weights(t), d, _weights(d), dev, str(dtype), torch.get_num_threads(), torch.__version__,
             sorted(grid.items()), _host(), _step_code()]
    return hashlib.sha256(json.dumps(parts, default=str).encode()).hexdigest()[:32]


def cached(key: str) -> tuple[StepCosts, StepCosts | None] | None:
    """The greedy and sampled costs cached under ``key`` on this host, or None."""
    path = CACHE_DIR / f"calibration-{key}.json"
    try:
        data = json.loads(path.read_text())
        return StepCosts.from_dict(data["greedy"]), (StepCosts.from_dict(data["sampled"]) if data["sampled"] else None)
    except (OSError, ValueError, KeyError):
        return None


def store(key: str, greedy: StepCosts, sampled: StepCosts | None) -> None:
    """Cache a start-up calibration (written whole, then renamed: replicas starting together never
    read half a file)."""
    try:
        CACHE_DIR.mkdir(parents=True, exist_ok=True)
        tmp = CACHE_DIR / f".calibration-{key}.{os.getpid()}.tmp"
        tmp.write_text(json.dumps({"greedy": greedy.to_dict(), "sampled": sampled.to_dict() if sampled else None,
                                   "created": time.time()}))
        tmp.replace(CACHE_DIR / f"calibration-{key}.json")
    except OSError:
        logger.warning("could not cache the calibration in %s", CACHE_DIR, exc_info=True)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description="Measure step costs of a target/draft pair on this machine.")
    ap.add_argument("--target", default="models/target")
    ap.add_argument("--draft", default="models/draft")
    ap.add_argument("--out", default="calibration.json")
    ap.add_argument("--device", default=None)
    ap.add_argument("--dtype", default=None)
    ap.add_argument("--max-batch-size", type=int, default=32)
    ap.add_argument("--max-model-len", type=int, default=512)
    ap.add_argument("--threads", type=int, default=1, help="torch threads (match the replicas' torch_threads)")
    ap.add_argument("--batches", default=",".join(map(str, DEFAULT_BATCHES)))
    ap.add_argument("--qs", default=",".join(map(str, DEFAULT_QS)), help="verify widths K+1")
    args = ap.parse_args(argv)

    import torch

    from specdec_core import Engine
    from specdec_core.calibration import calibrate

    torch.set_num_threads(args.threads)
    engine = Engine.from_pretrained(target=args.target, draft=args.draft, device=args.device, dtype=args.dtype,
                                    max_batch_size=args.max_batch_size, max_model_len=args.max_model_len)
    t0 = time.perf_counter()
    costs = calibrate(engine, batches=tuple(int(b) for b in args.batches.split(",")),
                      qs=tuple(int(q) for q in args.qs.split(",")), long_context_len=args.max_model_len // 2)
    rec = record(costs, args.target, args.draft, device_kind(engine.target.device), torch_threads=args.threads,
                 calibrate_s=round(time.perf_counter() - t0, 2))
    save_calibration(args.out, rec)
    print(f"wrote {args.out} ({rec['calibrate_s']} s): t_T(1,1)={costs.target_time(1, 1) * 1e3:.2f} ms, "
          f"t_D(1)={costs.draft_time(1) * 1e3:.2f} ms, batches {list(costs.batches)}")


if __name__ == "__main__":
    main()
