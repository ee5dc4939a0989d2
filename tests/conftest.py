"""Shared fixtures: tiny random-init HF Llama models saved with ``save_pretrained`` so every test
goes through the real ``from_pretrained`` loading code."""

from __future__ import annotations

import os

import pytest
import torch

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
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


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory):
    """Paths of a 3-layer target and a 1-layer draft sharing one tokenizer."""
    root = tmp_path_factory.mktemp("tiny_models")
    tok = build_tokenizer(str(root / "tokenizer"))
    target = build_model(str(root / "target"), tok, num_layers=3, seed=0)
    draft = build_model(str(root / "draft"), tok, num_layers=1, seed=1)
    return {"target": target, "draft": draft}
