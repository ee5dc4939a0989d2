"""Automatic prefix caching (specdec_core/prefix_cache.py): a restored prefix is the prefill it skips,
outputs do not change, blocks are found only through their exact context, eviction is LRU."""

import pytest
import torch

from specdec_core import Engine
from specdec_core.prefix_cache import PrefixCache
from specdec_core.runner import ModelRunner

LONG = ("It is a truth universally acknowledged, that a single man in possession of a good fortune, must be in "
        "want of a wife. However little known the feelings or views of such a man may be")
PROMPTS = [LONG, LONG + " on his first entering a neighbourhood", "def fibonacci(n):\n    if n < 2:\n        return n"
           "\n    return fibonacci(n - 1) + fibonacci(n - 2)\n\n\ndef main():"]


@pytest.fixture(scope="module")
def plain_reference(tiny_models):
    engine = Engine.from_pretrained(tiny_models["target"], tiny_models["draft"], max_batch_size=4, max_model_len=256)
    return [o.token_ids for o in engine.generate(PROMPTS, max_new_tokens=20, mode="plain")]


def test_a_restored_prefix_gives_the_logits_of_a_full_prefill(tiny_models):
    runner = ModelRunner.from_pretrained(tiny_models["target"], max_slots=3, max_len=128, prefix_cache_tokens=64)
    tokens = torch.randint(5, runner.vocab_size, (40,), generator=torch.Generator().manual_seed(0)).tolist()
    first = runner.allocate()
    full = runner.forward([first], [tokens], [8])  # [1, 8, V]: the last 8 positions' logits
    runner.keep_prefix(first, tokens)
    runner.free(first)
    assert len(runner.prefix_cache) == 2  # two full blocks of 16; the last 8 tokens stay out

    slot = runner.allocate()
    assert runner.reuse_prefix(slot, tokens) == 32
    assert runner.length(slot) == 32
    resumed = runner.forward([slot], [tokens[32:]], [8])
    torch.testing.assert_close(resumed, full, rtol=1e-4, atol=1e-4)
    other = runner.allocate()
    runner.forward([other], [tokens], [1])
    for k_buf, v_buf in zip(runner.cache.keys, runner.cache.values):
        torch.testing.assert_close(k_buf[slot, :, :40], k_buf[other, :, :40], rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(v_buf[slot, :, :40], v_buf[other, :, :40], rtol=1e-4, atol=1e-4)


def test_a_block_is_found_only_after_its_own_context():
    cache = PrefixCache(num_layers=1, num_kv_heads=1, head_dim=2, capacity_tokens=16, dtype=torch.float32,
                        device="cpu", block_size=2)
    keys = [torch.arange(1 * 1 * 8 * 2, dtype=torch.float32).view(1, 1, 8, 2)]
    values = [k + 100 for k in keys]
    cache.store([1, 2, 3, 4, 5, 6, 7], keys, values, slot=0)  # blocks [1,2] [3,4] [5,6]; 7 stays out
    assert len(cache) == 3
    dst_k, dst_v = [torch.zeros(2, 1, 8, 2)], [torch.zeros(2, 1, 8, 2)]
    assert cache.restore([1, 2, 3, 4, 9, 9], dst_k, dst_v, slot=1) == 4
    torch.testing.assert_close(dst_k[0][1, :, :4], keys[0][0, :, :4])
    torch.testing.assert_close(dst_v[0][1, :, :4], values[0][0, :, :4])
    assert cache.restore([3, 4, 5, 6], dst_k, dst_v, slot=1) == 0  # [3,4] is stored, but after [1,2]
    assert cache.restore([1, 9, 3, 4], dst_k, dst_v, slot=1) == 0


def test_eviction_is_least_recently_used():
    cache = PrefixCache(num_layers=1, num_kv_heads=1, head_dim=1, capacity_tokens=6, dtype=torch.float32,
                        device="cpu", block_size=2)
    kv = [torch.zeros(1, 1, 6, 1)]
    dst = [torch.zeros(1, 1, 6, 1)]
    cache.store([1, 2], kv, kv, 0)
    cache.store([3, 4], kv, kv, 0)
    assert cache.restore([1, 2, 0], dst, dst, 0) == 2  # [1,2] is now the most recently used
    cache.store([5, 6, 7, 8], kv, kv, 0)  # [5,6] takes the free row, [7,8] the least recently used one
    assert cache.restore([1, 2], dst, dst, 0) == 2
    assert cache.restore([3, 4], dst, dst, 0) == 0
    assert cache.restore([5, 6, 7, 8], dst, dst, 0) == 4


def test_a_chain_longer_than_the_cache_keeps_its_first_blocks():
    cache = PrefixCache(num_layers=1, num_kv_heads=1, head_dim=1, capacity_tokens=4, dtype=torch.float32,
                        device="cpu", block_size=2)
    kv = [torch.zeros(1, 1, 8, 1)]
    cache.store([1, 2, 3, 4, 5, 6, 7, 8], kv, kv, 0)
    assert cache.restore([1, 2, 3, 4, 5, 6, 7, 8], kv, kv, 0) == 4


@pytest.mark.parametrize("mode", ["plain", "speculative"])
def test_outputs_are_unchanged_when_prompts_hit_the_cache(tiny_models, plain_reference, mode):
    engine = Engine.from_pretrained(tiny_models["target"], tiny_models["draft"], max_batch_size=4, max_model_len=256,
                                    prefix_cache_tokens=1024)
    for round_ in range(3):  # the first round fills the cache, the later ones start from it
        outs = engine.generate(PROMPTS, max_new_tokens=20, mode=mode, num_speculative_tokens=3)
        assert [o.token_ids for o in outs] == plain_reference, f"round {round_}"
    target_cache = engine.target.prefix_cache
    # Every prompt but the first has a full block of a prompt before it; in later rounds all of them do.
    assert target_cache.hit_tokens >= 2 * sum(len(engine.encode(p)) // 16 * 16 - 16 for p in PROMPTS)
    if mode == "speculative":
        assert engine.proposer.runner.prefix_cache.hit_tokens > 0


def test_a_bounded_draft_cache_keeps_no_prefixes(tiny_models):
    from specdec_core import KVWindow

    engine = Engine.from_pretrained(tiny_models["target"], tiny_models["draft"], max_batch_size=2, max_model_len=128,
                                    prefix_cache_tokens=256, draft_kv_window=KVWindow(2, 8))
    assert engine.target.prefix_cache is not None
    assert engine.proposer.runner.prefix_cache is None
