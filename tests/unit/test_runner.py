"""The runner's batched, ragged forward against HF's own forward of each whole sequence.

Rows of one forward differ in cached length and in new-token count, so the step needs a mask
(causal within a row, nothing of other rows) and a gather of each row's last positions; rows of
one new token at a common length take the unmasked path and the sliced logits.
"""

import pytest
import torch
from transformers import AutoModelForCausalLM, Qwen2Config, Qwen2ForCausalLM

from specdec_core.runner import ModelRunner


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def runner_and_reference(request, tiny_models, tmp_path_factory):
    """The fused Llama stack, and HF's own layers (Qwen2 has q/k/v biases: not fused)."""
    path = tiny_models["target"]
    if request.param == "qwen2":
        path = str(tmp_path_factory.mktemp("qwen2"))
        torch.manual_seed(0)
        config = Qwen2Config(vocab_size=384, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
        Qwen2ForCausalLM(config).save_pretrained(path)
    reference = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    runner = ModelRunner.from_pretrained(path, device="cpu", max_slots=4, max_len=64)
    assert (runner._fused is not None) == (request.param == "llama")
    return runner, reference


def _reference_logits(model, tokens: list[int], last: int) -> torch.Tensor:  # [last, V]
    with torch.inference_mode():
        return model(torch.tensor([tokens])).logits[0, -last:]


@pytest.mark.parametrize(
    "prompts, steps",
    [
        ([[5, 9, 2], [5, 9, 2]], [[[7], [8]], [[3], [4]]]),  # one token each at a common length: no mask
        ([[5, 9, 2], [1, 2, 3, 4, 5, 6]], [[[7], [8]]]),  # one token each at different lengths
        ([[5, 9], [1, 2, 3, 4]], [[[7, 8, 9], [6]], [[1], [2, 3]]]),  # ragged new tokens: padding, gather
        # One wide row beside one-token rows: it attends alone, the others through the one-token kernel
        # (runner.ROW_CALL_QUERIES: cheaper than padding every row to 7 queries).
        ([[5, 9], [1, 2, 3], [4, 4, 4, 4], [7]], [[[1, 2, 3, 4, 5, 6, 7], [8], [9], [3]]]),
        ([[5, 9], [1, 2, 3], [4, 4, 4, 4], [7]], [[[1, 2], [8], [9, 1], [3]]]),  # two wide rows: padded
        # A prefill beside verify rows: it attends alone, the others padded to their own width
        ([[5, 9], [1, 2, 3], [4, 4, 4, 4], [7]], [[list(range(1, 21)), [8, 1], [9, 1, 2], [3, 2]]]),
    ],
)
def test_ragged_batched_forward_matches_hf(runner_and_reference, prompts, steps):
    runner, reference = runner_and_reference
    slots = [runner.allocate() for _ in prompts]
    try:
        histories = [list(p) for p in prompts]
        runner.forward(slots, [list(p) for p in prompts], [1] * len(prompts))
        for new_tokens in steps:
            num_logits = [len(t) for t in new_tokens]
            logits = runner.forward(slots, new_tokens, num_logits)  # [B, max n, V]
            for row, (history, toks, n) in enumerate(zip(histories, new_tokens, num_logits)):
                history.extend(toks)
                expected = _reference_logits(reference, history, n)
                torch.testing.assert_close(logits[row, :n], expected, rtol=1e-4, atol=1e-4)
    finally:
        for slot in slots:
            runner.free(slot)


@pytest.mark.parametrize("heads, kv_heads", [(6, 6), (8, 2)])
@pytest.mark.parametrize("masked", [True, False])
def test_decode_attention_is_sdpa_on_the_head_major_cache(heads, kv_heads, masked):
    """One new token per row: the matrix-vector formulation gives SDPA's answer (GQA too, with a mask
    or none) on the cache's strided views."""
    import torch.nn.functional as F

    from specdec_core.fused_llama import decode_attention

    gen = torch.Generator().manual_seed(0)
    batch, length, dim = 5, 37, 16
    cache_k, cache_v = (torch.randn(8, kv_heads, 64, dim, generator=gen) for _ in range(2))  # [slots, kv, max_len, D]
    keys, values = cache_k[:batch, :, :length], cache_v[:batch, :, :length]
    q = torch.randn(batch, 1, heads, dim, generator=gen).transpose(1, 2)  # [B, heads, 1, D]
    mask = None
    if masked:
        mask = torch.arange(length).view(1, 1, 1, -1) < torch.tensor([37, 20, 1, 30, 5]).view(-1, 1, 1, 1)
    ref = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, scale=dim ** -0.5,
                                         enable_gqa=heads != kv_heads)
    torch.testing.assert_close(decode_attention(q, keys, values, mask, dim ** -0.5), ref, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("heads, kv_heads", [(6, 6), (8, 2)])
@pytest.mark.parametrize("q_len", [2, 5, 9])
def test_verify_attention_is_sdpa_on_the_head_major_cache(heads, kv_heads, q_len):
    """A few query tokens a row, causal within the row (a verify): the batched products give SDPA's
    answer on the cache's strided views, over the padded batch and row by row beside the one-token
    kernel (the narrow rows' first query)."""
    import torch.nn.functional as F

    from specdec_core.fused_llama import ragged_attention, small_query_attention

    gen = torch.Generator().manual_seed(0)
    batch, length, dim, scale = 5, 37, 16, 16 ** -0.5
    cache_k, cache_v = (torch.randn(8, kv_heads, 64, dim, generator=gen) for _ in range(2))  # [slots, kv, max_len, D]
    keys, values = cache_k[:batch, :, :length], cache_v[:batch, :, :length]
    q = torch.randn(batch, q_len, heads, dim, generator=gen).transpose(1, 2)  # [B, heads, Q, D]
    ends = torch.tensor([37, 20, 9, 30, 12])  # each row's length with its new tokens
    positions = ends.view(-1, 1) - q_len + torch.arange(q_len)  # [B, Q]
    mask = torch.arange(length).view(1, 1, 1, -1) <= positions.view(batch, 1, q_len, 1)  # [B, 1, Q, T]
    ref = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, scale=scale, enable_gqa=heads != kv_heads)
    torch.testing.assert_close(small_query_attention(q, keys, values, mask, scale), ref, rtol=1e-5, atol=1e-6)
    wide, narrow = [1, 3], [0, 2, 4]
    for width in range(1, q_len):  # the narrow rows' first queries at once, the wide ones alone
        out = ragged_attention(q, keys, values, mask, scale, width, tuple(wide), heads != kv_heads)
        torch.testing.assert_close(out[wide], ref[wide], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(out[narrow, :, :width], ref[narrow, :, :width], rtol=1e-5, atol=1e-6)


@pytest.fixture(scope="module")
def sliding_mistral(tmp_path_factory):
    """A random Mistral whose every layer attends to the last WINDOW positions (transformers' mask)."""
    from transformers import MistralConfig, MistralForCausalLM

    path = str(tmp_path_factory.mktemp("mistral"))
    torch.manual_seed(0)
    config = MistralConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                           sliding_window=WINDOW)
    MistralForCausalLM(config).save_pretrained(path)
    return path


WINDOW = 12


def test_bounded_cache_attends_like_a_sliding_window(sliding_mistral):
    """A ring of WINDOW + 3 columns turned many times, fed 1-4 tokens a forward with rollbacks between:
    every logit equals the full cache's under transformers' own sliding-window mask (sinks 0)."""
    from specdec_core.kv_cache import KVWindow

    full = ModelRunner.from_pretrained(sliding_mistral, device="cpu", max_slots=2, max_len=200)
    ring = ModelRunner.from_pretrained(sliding_mistral, device="cpu", max_slots=2, max_len=200,
                                       kv_window=KVWindow(sinks=0, window=WINDOW, slack=3))
    assert ring.cache.keys[0].shape[2] == WINDOW + 3 + 1  # the ring and the trash column: not max_len
    gen = torch.Generator().manual_seed(1)
    slots = [(full.allocate(), ring.allocate()) for _ in range(2)]
    # Prompts within the window: a longer prefill keeps only its last window tokens (``KVWindow.kept``),
    # whose own keys then saw fewer than a window: a draft's approximation, not this equality.
    prompts = [torch.randint(0, 256, (n,), generator=gen).tolist() for n in (5, WINDOW)]
    for (fs, rs), prompt in zip(slots, prompts):
        torch.testing.assert_close(ring.forward([rs], [prompt], [1]), full.forward([fs], [prompt], [1]))
    for step in range(40):
        widths = [1 + (step + row) % 4 for row in range(2)]
        feeds = [torch.randint(0, 256, (w,), generator=gen).tolist() for w in widths]
        got = ring.forward([r for _, r in slots], feeds, widths)
        want = full.forward([f for f, _ in slots], feeds, widths)
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
        for (fs, rs), w in zip(slots, widths):  # a rejection: the last token rolled back
            if w > 1:
                full.truncate(fs, full.length(fs) - 1)
                ring.truncate(rs, ring.length(rs) - 1)
    assert ring.length(slots[1][1]) > 3 * (WINDOW + 3)


def test_bounded_cache_keeps_its_sinks():
    """The mask sees the sink positions and the last ``window`` up to each query, nothing stale or empty."""
    from specdec_core.kv_cache import KVWindow, SlotKVCache

    window = KVWindow(sinks=2, window=4, slack=2)
    cache = SlotKVCache(1, 1, 1, 2, window.columns, torch.float32, "cpu", window=window)
    positions = list(range(0, 13))
    cache.record([0] * len(positions), positions)
    columns = cache.column_positions[0].tolist()
    assert columns == [0, 1, 8, 9, 10, 11, 12, 7]  # the ring of 6 columns after position 12
    mask = cache.window_mask(torch.tensor([0]), torch.tensor([[10, 12]]), window.columns)[0, 0]
    seen = [[p for p, m in zip(columns, row) if m] for row in mask.tolist()]
    assert seen == [[0, 1, 8, 9, 10, 7], [0, 1, 9, 10, 11, 12]]
    assert window.kept(0, 20) == [0, 1, 16, 17, 18, 19]  # a long prefill: the sinks and the window


@pytest.mark.parametrize("q, split", [
    ([1, 1, 1, 1], (None, 1)),
    ([5, 5, 5, 30], ((3,), 5)),  # a prefill beside K=4 rows: it alone, the rows at their own width
    ([1, 5, 1, 5], (None, 5)),  # two wide rows of four: padding is cheaper than two calls
    ([1] * 7 + [9], ((7,), 1)),
    ([1, 5, 5, 5, 5, 5, 5, 40], ((7,), 5)),
])
def test_attention_split_pads_to_the_width_that_costs_the_fewest_queries(q, split):
    from specdec_core.runner import attention_split

    assert attention_split(q) == split
