"""Random-init Llama models saved with ``save_pretrained`` (and a BPE tokenizer trained on a few
lines), so that tests and benchmarks go through the real ``from_pretrained`` loading code without
the trained family: the test suite's fixtures, and ``specdec-bench``'s memory-bound stand-ins."""

from __future__ import annotations

import torch

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
