"""Loading: a target model and its proposer from local paths or hub names, checked to speculate together.

Vocabulary: the *target* is the model whose distribution p the output follows; the *proposer*
drafts the K tokens a step verifies, either a *draft* model (its distribution q, Leviathan et al.
2023) or an n-gram lookup of the history ("ngram", no model). Draft and target must share one
vocabulary, since speculation compares token ids.
"""

from __future__ import annotations

import torch

from specdec_core.kv_cache import KVWindow
from specdec_core.proposers import DraftModelProposer, NgramProposer, Proposer
from specdec_core.runner import ModelRunner, load_tokenizer

PROPOSERS = ("draft", "ngram")


def load_models(
    target: str,
    draft: str | None = None,
    proposer: str | None = None,
    *,
    device: str | None = None,
    dtype: str | torch.dtype | None = None,
    max_slots: int = 32,
    max_len: int = 1024,
    trust_remote_code: bool = False,
    ngram_max_n: int = 4,
    draft_kv_window: KVWindow | None = None,
    prefix_cache_tokens: int = 0,
) -> tuple[ModelRunner, object, Proposer]:
    """(target runner, target tokenizer, proposer). ``proposer`` is "draft" (needs ``draft``) or
    "ngram"; by default "draft" when a draft is given, else "ngram", so every engine can speculate.
    ``draft_kv_window`` bounds the draft's cache (attention sinks + a recent window, ``KVWindow``)."""
    proposer = proposer or ("draft" if draft else "ngram")
    if proposer not in PROPOSERS:
        raise ValueError(f"proposer must be 'draft' or 'ngram', got {proposer!r}")
    if proposer == "draft" and not draft:
        raise ValueError("proposer='draft' needs a draft model path")
    tokenizer = load_tokenizer(target, trust_remote_code)
    runner_kw = {"device": device, "dtype": dtype, "max_slots": max_slots, "max_len": max_len,
                 "trust_remote_code": trust_remote_code, "prefix_cache_tokens": prefix_cache_tokens}
    target_runner = ModelRunner.from_pretrained(target, **runner_kw)
    if proposer == "ngram":
        return target_runner, tokenizer, NgramProposer(max_n=ngram_max_n)
    check_same_tokenizer(tokenizer, load_tokenizer(draft, trust_remote_code), target, draft)
    draft_runner = ModelRunner.from_pretrained(draft, **runner_kw, kv_window=draft_kv_window)
    if draft_runner.vocab_size != target_runner.vocab_size:
        raise ValueError(
            f"draft vocab size {draft_runner.vocab_size} != target vocab size {target_runner.vocab_size}"
        )
    return target_runner, tokenizer, DraftModelProposer(draft_runner, name=str(draft))


def check_same_tokenizer(target_tok, draft_tok, target_name: str, draft_name: str) -> None:
    """Speculation compares token ids, so draft and target must share one vocabulary."""
    if target_tok.get_vocab() != draft_tok.get_vocab():
        raise ValueError(
            f"draft {draft_name!r} and target {target_name!r} have different tokenizers "
            f"({len(draft_tok)} vs {len(target_tok)} tokens); speculative decoding needs a shared vocabulary"
        )
