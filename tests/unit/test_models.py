"""The shipped model family loads with plain HF calls, generates, and shares one vocabulary."""
import json
import os
from pathlib import Path

import pytest

MODELS = Path(os.environ.get("MODELZOO_MODELS", Path(__file__).resolve().parents[2] / "models"))
NAMES = ["target", "draft", "draft-code", "draft-large"]
SHIPPED = [n for n in NAMES if (MODELS / n / "config.json").exists()]

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def tok_target():
    if "target" not in SHIPPED:
        pytest.skip("models/target not shipped")
    return transformers.AutoTokenizer.from_pretrained(str(MODELS / "target"))


def test_target_is_shipped():
    assert "target" in SHIPPED, f"no model under {MODELS}/target"


@pytest.mark.parametrize("name", SHIPPED)
def test_loads_and_generates(name):
    torch.set_num_threads(1)
    tok = transformers.AutoTokenizer.from_pretrained(str(MODELS / name))
    model = transformers.AutoModelForCausalLM.from_pretrained(str(MODELS / name), dtype=torch.float32).eval()
    assert model.config.model_type == "llama"
    assert model.config.tie_word_embeddings
    assert tok.eos_token == "<|endoftext|>" and tok.bos_token is not None
    for prompt in ("It is a truth universally acknowledged, that", "def main(argv=None):\n    "):
        ids = tok(prompt, return_tensors="pt")
        with torch.no_grad():
            out = model.generate(**ids, max_new_tokens=6, do_sample=False, pad_token_id=tok.pad_token_id)
        new = out[0, ids["input_ids"].shape[1]:]
        assert len(new) > 0
        assert tok.decode(new, skip_special_tokens=True) != "" or tok.decode(new) != ""


@pytest.mark.parametrize("name", [n for n in SHIPPED if n != "target"])
def test_draft_shares_target_vocabulary(name, tok_target):
    tok = transformers.AutoTokenizer.from_pretrained(str(MODELS / name))
    assert tok.get_vocab() == tok_target.get_vocab()
    assert tok.eos_token_id == tok_target.eos_token_id and tok.pad_token_id == tok_target.pad_token_id
    cfg_d = json.loads((MODELS / name / "config.json").read_text())
    cfg_t = json.loads((MODELS / "target" / "config.json").read_text())
    assert cfg_d["vocab_size"] == cfg_t["vocab_size"] == len(tok_target)


def test_prompt_sets():
    sizes = {"prose": 64, "code": 64, "repetitive": 32, "long": 16}
    for name, n in sizes.items():
        rows = [json.loads(l) for l in (MODELS / "prompts" / f"{name}.jsonl").read_text().splitlines() if l.strip()]
        assert len(rows) == n and all(r["prompt"].strip() for r in rows), name


def test_the_tiny_family_stays_under_40mb():
    """The test fixtures (the tiny family and the prompt sets) stay small; models/dram is the served family."""
    total = sum(p.stat().st_size for d in [*NAMES, "prompts"] for p in (MODELS / d).rglob("*") if p.is_file())
    assert total < 40 * 2**20, total


DRAM = MODELS / "dram"


def test_the_served_target_speculates_losslessly():
    """The served family's target (models/dram/target, 137 MB of fp32 weights: decode streams them
    from DRAM) loads through from_pretrained and decodes greedy speculatively exactly as plain, with
    the cheap draft, on prose and code."""
    from specdec_core import Engine

    assert (DRAM / "target" / "config.json").exists(), f"no served target under {DRAM}"
    torch.set_num_threads(1)
    engine = Engine.from_pretrained(str(DRAM / "target"), str(DRAM / "draft"), max_batch_size=2, max_model_len=256)
    prompts = ["It is a truth universally acknowledged, that", "def main(argv=None):\n    "]
    plain = engine.generate(prompts, max_new_tokens=32, mode="plain")
    spec = engine.generate(prompts, max_new_tokens=32, mode="speculative", num_speculative_tokens=4)
    assert [o.token_ids for o in spec] == [o.token_ids for o in plain]
    assert all(o.stats.accepted > 0 for o in spec)  # the draft agrees with it: real acceptance


def test_growth_preserves_the_function():
    """modelzoo.grow widens (here 2x) and deepens (one identity layer) a trained model into one that
    computes the same logits: the served target's starting point."""
    from modelzoo.grow import grow

    small = transformers.AutoModelForCausalLM.from_pretrained(str(MODELS / "target"), dtype=torch.float32).eval()
    c = small.config
    wide = transformers.LlamaConfig(**{**c.to_dict(), "hidden_size": 2 * c.hidden_size,
                                       "num_attention_heads": 2 * c.num_attention_heads,
                                       "num_key_value_heads": 2 * c.num_key_value_heads, "head_dim": c.head_dim,
                                       "intermediate_size": 3 * c.intermediate_size,
                                       "num_hidden_layers": c.num_hidden_layers + 1})
    torch.manual_seed(0)
    big = transformers.LlamaForCausalLM(wide).eval()
    grow(big, small, new_layers=[2])
    x = torch.randint(0, c.vocab_size, (2, 48))
    with torch.no_grad():
        assert torch.allclose(big(input_ids=x).logits, small(input_ids=x).logits, atol=1e-4)


def test_a_widened_model_computes_the_same_logits_from_four_times_the_weights(tiny_models, tmp_path):
    """`python -m modelzoo.grow SRC OUT --factor 2`: the served family's target made larger than a host's
    cache (models/dram-wide), same function, loaded by a plain from_pretrained."""
    from modelzoo.grow import main

    main([tiny_models["target"], str(tmp_path / "wide"), "--factor", "2"])
    small = transformers.AutoModelForCausalLM.from_pretrained(tiny_models["target"]).eval()
    wide = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "wide")).eval()
    assert wide.dtype == torch.float32 and wide.config.hidden_size == 2 * small.config.hidden_size
    layer_params = [sum(p.numel() for p in m.model.layers.parameters()) for m in (small, wide)]
    assert layer_params[1] == pytest.approx(4 * layer_params[0], rel=0.01)  # norms grow 2x, matrices 4x
    x = torch.randint(0, small.config.vocab_size, (2, 24))
    with torch.no_grad():
        torch.testing.assert_close(wide(input_ids=x).logits, small(input_ids=x).logits, atol=1e-4, rtol=1e-4)


def test_a_recipe_folder_is_built_where_it_runs_and_the_same_every_time(tiny_models, tmp_path):
    """models/dram-wide keeps only recipes in git (grown.json); the app builder and the benchmark build
    what is missing, byte for byte the model `modelzoo.grow` wrote."""
    from modelzoo.grow import build, build_missing, widen

    family = tmp_path / "family"
    widen(tiny_models["target"], family / "target", factor=2)
    first = (family / "target" / "model.safetensors").read_bytes()
    (family / "target" / "model.safetensors").unlink()
    assert build_missing(family) == [family / "target"]
    assert (family / "target" / "model.safetensors").read_bytes() == first
    assert not build(family / "target")  # built: nothing to do
    assert not build(tiny_models["draft"])  # a trained model is no recipe
