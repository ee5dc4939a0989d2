"""Every model family the runner accepts decodes exactly like transformers, or is refused at load.

Each case is a tiny random-init checkpoint carrying what sets its family (or a config variant the
runner accepts) apart from plain Llama. The engine's plain greedy output must equal transformers'
own greedy ``generate`` token for token, and speculative output must equal plain, with a draft that
is the target plus noise: it agrees often but not always, so verify passes both use logits past an
accepted draft token and roll the caches back after a rejection. Sliding windows are 8 tokens,
against prompts of 3 and 20 tokens and 24 new tokens: prefill, decode and verify all run past the
window. Configs the runner cannot reproduce must raise a ValueError naming the feature.
"""

import pytest
import torch
import transformers as tf

from modelzoo.random_init import build_noisy_copy, build_tokenizer
from specdec_core import Engine
from specdec_core.runner import ModelRunner

WINDOW = 8
PROMPTS = [[5, 9, 12], list(range(40, 60))]  # shorter and longer than the window
MAX_NEW_TOKENS = 24
DRAFT_NOISE = 0.05  # of each weight's std: the draft's greedy token is the target's about half the time
SMALL = {
    "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2,  # GQA everywhere
    "max_position_embeddings": 128,
    # A wide init makes logits peaked, so greedy ties (which fp noise could break either way) do not occur.
    "initializer_range": 0.3,
}
SLIDING = {"use_sliding_window": True, "sliding_window": WINDOW}


def _rope(rope_type: str, **params) -> dict:
    return {"rope_parameters": {"rope_type": rope_type, "rope_theta": 10000.0, **params}}


LLAMA3_ROPE = _rope(
    "llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=32
)
GRANITE = {"embedding_multiplier": 3.0, "residual_multiplier": 0.5, "attention_multiplier": 0.2,
           "logits_scaling": 2.0}

# name -> (config class, model class, what sets the case apart)
CASES = {
    # fused; tied embeddings; head_dim 32 where hidden / heads is 16
    "llama": (tf.LlamaConfig, tf.LlamaForCausalLM,
              {"tie_word_embeddings": True, "head_dim": 32, **LLAMA3_ROPE}),
    # not fusable: HF's own Llama layers
    "llama-biases": (tf.LlamaConfig, tf.LlamaForCausalLM, {"attention_bias": True, "mlp_bias": True}),
    "llama-rope-linear": (tf.LlamaConfig, tf.LlamaForCausalLM, _rope("linear", factor=4.0)),
    "llama-rope-yarn": (tf.LlamaConfig, tf.LlamaForCausalLM,
                        _rope("yarn", factor=4.0, original_max_position_embeddings=32)),
    "llama-rope-dynamic": (tf.LlamaConfig, tf.LlamaForCausalLM, _rope("dynamic", factor=4.0)),
    # fused; every layer slides
    "mistral": (tf.MistralConfig, tf.MistralForCausalLM, {"sliding_window": WINDOW}),
    # q/k/v biases; tied embeddings; layer 1 slides (max_window_layers)
    "qwen2": (tf.Qwen2Config, tf.Qwen2ForCausalLM,
              {**SLIDING, "max_window_layers": 1, "tie_word_embeddings": True}),
    # q/k norms; head_dim 32; layer 1 slides
    "qwen3": (tf.Qwen3Config, tf.Qwen3ForCausalLM, {**SLIDING, "max_window_layers": 1, "head_dim": 32}),
    "granite": (tf.GraniteConfig, tf.GraniteForCausalLM, GRANITE),
    # post-norms; q/k norms over all heads at once
    "olmo2": (tf.Olmo2Config, tf.Olmo2ForCausalLM, {}),
    # layer 1 has no RoPE and slides; tied embeddings by default
    "smollm3": (tf.SmolLM3Config, tf.SmolLM3ForCausalLM, {**SLIDING, "no_rope_layers": [1, 0]}),
}

# name -> (config class, model class, config features, what the error must name)
REFUSED = {
    "family": (tf.GemmaConfig, tf.GemmaForCausalLM, {"head_dim": 16}, "model type 'gemma'"),
    "rope-type": (tf.LlamaConfig, tf.LlamaForCausalLM, _rope(
        "longrope", short_factor=[1.0] * 8, long_factor=[2.0] * 8, original_max_position_embeddings=32
    ), "rope_type 'longrope'"),
    "soft-capping": (tf.LlamaConfig, tf.LlamaForCausalLM, {"attn_logit_softcapping": 30.0},
                     "attn_logit_softcapping"),
    "layer-type": (tf.Qwen2Config, tf.Qwen2ForCausalLM,
                   {"layer_types": ["full_attention", "chunked_attention"]}, "chunked_attention"),
}


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return build_tokenizer(str(tmp_path_factory.mktemp("conformance_tokenizer")))


@pytest.fixture(scope="module", params=list(CASES))
def checkpoints(request, tokenizer, tmp_path_factory):
    """(target, draft) paths of one case: the same config, the draft's weights the target's plus noise."""
    config_cls, model_cls, features = CASES[request.param]
    special = {  # SmolLM3's default pad id lies outside a tiny vocabulary
        "eos_token_id": tokenizer.eos_token_id, "bos_token_id": tokenizer.eos_token_id,
        "pad_token_id": tokenizer.pad_token_id,
    }
    torch.manual_seed(0)
    model = model_cls(config_cls(**SMALL, **features, vocab_size=len(tokenizer), **special))
    root = tmp_path_factory.mktemp(request.param)
    target = str(root / "target")
    model.save_pretrained(target)
    tokenizer.save_pretrained(target)
    return target, build_noisy_copy(target, str(root / "draft"), DRAFT_NOISE, seed=0)


@pytest.fixture(scope="module")
def engine(checkpoints):
    target, draft = checkpoints
    return Engine.from_pretrained(target, draft, device="cpu", max_batch_size=4, max_model_len=64)


def _until_eos(tokens: list[int], eos: set[int]) -> list[int]:
    return tokens[: next((i for i, t in enumerate(tokens) if t in eos), len(tokens))]


def test_plain_greedy_equals_transformers_generate(checkpoints, engine):
    model = tf.AutoModelForCausalLM.from_pretrained(checkpoints[0], dtype=torch.float32).eval()
    outs = engine.generate(PROMPTS, max_new_tokens=MAX_NEW_TOKENS, mode="plain")  # one ragged batch
    for prompt, out in zip(PROMPTS, outs):
        with torch.inference_mode():
            hf = model.generate(
                torch.tensor([prompt]), max_new_tokens=MAX_NEW_TOKENS, do_sample=False, pad_token_id=0
            )[0, len(prompt):].tolist()
        assert out.token_ids == _until_eos(hf, set(engine.eos_token_ids))


def test_prompt_logits_equal_transformers(checkpoints, engine):
    """Greedy output is blind to a logit scale (Granite's logits_scaling); sampling is not."""
    model = tf.AutoModelForCausalLM.from_pretrained(checkpoints[0], dtype=torch.float32).eval()
    runner, prompt = engine.target, PROMPTS[1]
    slot = runner.allocate()
    try:
        logits = runner.forward([slot], [prompt], [len(prompt)])[0]  # [len(prompt), V]
    finally:
        runner.free(slot)
    with torch.inference_mode():
        expected = model(torch.tensor([prompt])).logits[0]
    torch.testing.assert_close(logits, expected, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("k", [1, 4])
def test_speculative_equals_plain(engine, k):
    plain = engine.generate(PROMPTS, max_new_tokens=MAX_NEW_TOKENS, mode="plain")
    spec = engine.generate(PROMPTS, max_new_tokens=MAX_NEW_TOKENS, num_speculative_tokens=k)
    assert [o.token_ids for o in spec] == [o.token_ids for o in plain]
    proposed, accepted = (sum(getattr(o.stats, n) for o in spec) for n in ("proposed", "accepted"))
    assert 0 < accepted < proposed, "the draft should be both accepted and rejected"


@pytest.mark.parametrize("case", list(REFUSED))
def test_unsupported_config_is_refused(case):
    config_cls, model_cls, features, named = REFUSED[case]
    torch.manual_seed(0)
    model = model_cls(config_cls(**SMALL, **features, vocab_size=64))
    with pytest.raises(ValueError, match=named):
        ModelRunner(model, max_slots=1, max_len=16)
