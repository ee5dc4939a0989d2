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
def test_decode_attention_is_sdpa_on_the_position_major_cache(heads, kv_heads, masked):
    """One new token per row: the streaming formulation gives SDPA's answer (GQA too, with a mask or
    none) on the cache's transposed views."""
    import torch.nn.functional as F

    from specdec_core.fused_llama import decode_attention

    gen = torch.Generator().manual_seed(0)
    batch, length, dim = 5, 37, 16
    cache_k, cache_v = (torch.randn(8, 64, kv_heads, dim, generator=gen) for _ in range(2))  # [slots, max_len, kv, D]
    keys, values = cache_k[:batch, :length].transpose(1, 2), cache_v[:batch, :length].transpose(1, 2)
    q = torch.randn(batch, 1, heads, dim, generator=gen).transpose(1, 2)  # [B, heads, 1, D]
    mask = None
    if masked:
        mask = torch.arange(length).view(1, 1, 1, -1) < torch.tensor([37, 20, 1, 30, 5]).view(-1, 1, 1, 1)
    ref = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, scale=dim ** -0.5,
                                         enable_gqa=heads != kv_heads)
    torch.testing.assert_close(decode_attention(q, keys, values, mask, dim ** -0.5), ref, rtol=1e-5, atol=1e-6)
