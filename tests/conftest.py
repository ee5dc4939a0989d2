"""Shared fixtures: tiny random-init HF Llama models saved with ``save_pretrained`` so every test
goes through the real ``from_pretrained`` loading code."""

from __future__ import annotations

import os
import tempfile

import pytest
import torch

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Ray's token authentication on, as ./run has it (SECURITY.md); set before anything imports Ray, which
# reads the mode once per process. ray.init() then generates the token for a new local cluster.
os.environ.setdefault("RAY_AUTH_MODE", "token")
os.environ.setdefault("RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH", "deployments.proxy_edge:middlewares")  # as ./run
# Start-up calibrations of the suite's models stay in a cache of the run's own (deployments/calibrate.py).
os.environ.setdefault("SPECDEC_CALIBRATION_CACHE", tempfile.mkdtemp(prefix="specdec-calibration-"))
torch.set_num_threads(1)

_CORPUS = [
    "It is a truth universally acknowledged, that a single man in possession of a good fortune, "
    "must be in want of a wife.",
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)\n",
    "In the beginning God created the heaven and the earth. And the earth was without form, and void.",
    "for i in range(10):\n    print(i, i * i)\n",
] * 20


def build_tokenizer(path: str):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=384, special_tokens=["<|endoftext|>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(_CORPUS, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>", pad_token="<|endoftext|>")
    fast.save_pretrained(path)
    return fast


def build_model(path: str, tokenizer, num_layers: int, seed: int, hidden: int = 64):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=hidden,
        intermediate_size=hidden * 2,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        # A wide init makes logits peaked, so greedy ties (which fp noise could break either way) do not occur.
        initializer_range=0.3,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=tokenizer.eos_token_id,
        tie_word_embeddings=False,
    )
    model = LlamaForCausalLM(config)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def build_noisy_copy(src: str, dst: str, noise: float, seed: int) -> str:
    """A draft that agrees with the target ``src`` only partly: its weights plus Gaussian noise of
    ``noise`` times each tensor's standard deviation (0.05 gives acceptance ~0.35 at T=1, top-k 8)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(src)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(torch.randn(param.shape, generator=gen) * noise * param.std())
    model.save_pretrained(dst)
    AutoTokenizer.from_pretrained(src).save_pretrained(dst)
    return dst


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


def exact_marginals(model_path: str, prompt: list[int], depth: int, temperature: float, top_k: int, top_p: float
                    ) -> list[torch.Tensor]:
    """The processed target distribution of output tokens 1..depth, marginalised exactly over the
    tokens before them (HF forwards over the whole support tree; small for top-k sampling)."""
    from transformers import AutoModelForCausalLM

    from specdec_core.sampling import process_logits

    model = AutoModelForCausalLM.from_pretrained(model_path)
    knobs = (torch.tensor([temperature]), torch.tensor([top_p]), torch.tensor([top_k]))

    @torch.no_grad()
    def dist(ids):
        return process_logits(model(torch.tensor([ids])).logits[0, -1:], *knobs)[0]

    marginals, paths = [], [(prompt, 1.0)]
    for _ in range(depth):
        level = torch.zeros(model.config.vocab_size)
        next_paths = []
        for ids, weight in paths:
            p = dist(ids)
            level += weight * p
            next_paths += [(ids + [t], weight * p[t].item()) for t in p.nonzero().flatten().tolist()]
        marginals.append(level)
        paths = next_paths
    return marginals


def expected_tv(p: torch.Tensor, n: int) -> float:
    """Mean total-variation distance of an n-sample histogram from its own distribution p
    (normal approximation of each bin's |error|)."""
    return 0.5 * torch.sqrt(2 * p * (1 - p) / (torch.pi * n)).sum().item()
