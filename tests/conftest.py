"""Shared fixtures: tiny random-init HF Llama models saved with ``save_pretrained`` so every test
goes through the real ``from_pretrained`` loading code."""

from __future__ import annotations

import os
import tempfile

import pytest
import torch

from modelzoo.random_init import build_model, build_noisy_copy, build_tokenizer

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Ray's token authentication on, as ./run has it (SECURITY.md); set before anything imports Ray, which
# reads the mode once per process. ray.init() then generates the token for a new local cluster.
os.environ.setdefault("RAY_AUTH_MODE", "token")
os.environ.setdefault("RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH", "deployments.proxy_edge:middlewares")  # as ./run
# Start-up calibrations of the suite's models stay in a cache of the run's own (deployments/calibrate.py).
os.environ.setdefault("SPECDEC_CALIBRATION_CACHE", tempfile.mkdtemp(prefix="specdec-calibration-"))
torch.set_num_threads(1)

@pytest.fixture(scope="session")
def noisy_draft(tiny_models, tmp_path_factory):
    return build_noisy_copy(tiny_models["target"], str(tmp_path_factory.mktemp("noisy") / "draft"), 0.05, seed=0)


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory):
    """Paths of a 3-layer target and a 1-layer draft sharing one tokenizer."""
    root = tmp_path_factory.mktemp("tiny_models")
    tok = build_tokenizer(str(root / "tokenizer"))
    target = build_model(str(root / "target"), tok, num_layers=3, seed=0)
    draft = build_model(str(root / "draft"), tok, num_layers=1, seed=1)
    return {"target": target, "draft": draft}
