"""Net2Net growth (Chen et al. 2016) of a pre-norm Llama: a wider, deeper model that computes exactly the
smaller one's logits, to be trained further (``modelzoo.train``, spec ``grow_from``), or served as it is
where a host's cache holds the smaller one (``widen``; models/dram-wide/README.md).

    python -m modelzoo.grow SRC OUT --factor 2    # write SRC widened 2x to OUT
    python -m modelzoo.grow --build models        # build every model there that is only a recipe"""
from __future__ import annotations

import os


def grow(model, small, new_layers: list) -> None:
    """Initialise ``model`` (wider by an integer factor r, deeper by ``new_layers``) so that it computes
    exactly ``small``'s logits (Net2WiderNet / Net2DeeperNet, Chen et al. 2016, for a pre-norm Llama):

    - residual stream: coordinate j of the wide model holds the small one's coordinate j % h, so an
      RMSNorm over it (mean of squares) is unchanged; every norm weight is tiled alike;
    - a layer's input projections read r copies: the small weight tiled along its input and divided by r;
      its output projections write every copy: the small weight tiled along its output;
    - the extra heads and ffn units get fresh weights but zero output columns, so they add nothing yet
      (their gradients are not zero: they start learning at once);
    - an inserted layer has zero o_proj and down_proj: an identity block of the residual stream;
    - embedding and head (tied or not): tiled, and the final norm divided by r, since logits sum over the r
      copies.
    """
    import torch
    h, H = small.config.hidden_size, model.config.hidden_size
    r = H // h
    assert r * h == H and model.config.head_dim == small.config.head_dim, (h, H)

    def tile(w, dims):  # repeat w r times along each dim in dims
        reps = [r if d in dims else 1 for d in range(w.dim())]
        return w.repeat(*reps)

    old_layers = iter(small.model.layers)
    with torch.no_grad():
        model.model.embed_tokens.weight.copy_(tile(small.model.embed_tokens.weight, {1}))
        model.model.norm.weight.copy_(tile(small.model.norm.weight, {0}) / r)
        if model.lm_head.weight is not model.model.embed_tokens.weight:  # an untied head reads every copy
            model.lm_head.weight.copy_(tile(small.lm_head.weight, {1}))
        for i, layer in enumerate(model.model.layers):
            attn, mlp = layer.self_attn, layer.mlp
            if i in new_layers:
                attn.o_proj.weight.zero_()
                mlp.down_proj.weight.zero_()
                continue
            old = next(old_layers)
            for norm in ("input_layernorm", "post_attention_layernorm"):
                getattr(layer, norm).weight.copy_(tile(getattr(old, norm).weight, {0}))
            for new_in, old_in in ((attn.q_proj, old.self_attn.q_proj), (attn.k_proj, old.self_attn.k_proj),
                                   (attn.v_proj, old.self_attn.v_proj), (mlp.gate_proj, old.mlp.gate_proj),
                                   (mlp.up_proj, old.mlp.up_proj)):
                rows = old_in.weight.shape[0]  # the small model's heads / units come first
                new_in.weight[:rows].copy_(tile(old_in.weight, {1}) / r)
            for new_out, old_out in ((attn.o_proj, old.self_attn.o_proj), (mlp.down_proj, old.mlp.down_proj)):
                cols = old_out.weight.shape[1]
                new_out.weight.zero_()
                new_out.weight[:, :cols].copy_(tile(old_out.weight, {0}))
    assert next(old_layers, None) is None, "every layer of the small model is placed"


RECIPE = "grown.json"  # how a built model was made: the folder it widens (relative), the factor, the seed


def widen(src, out, factor: int, seed: int = 0) -> None:
    """Write the model at ``src`` widened ``factor`` times (``grow``, no layer added) to ``out``: the same
    logits from factor^2 the weight bytes. The weights keep the dtype they have on disk (the family stores
    fp16 values, which tiling and a division by a power of two keep exact); the config says float32. The
    weights file lands last, by a rename: a folder with one is whole."""
    import json
    import tempfile
    from pathlib import Path

    import torch
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM, AutoTokenizer

    src, out = Path(src), Path(out)
    small = AutoModelForCausalLM.from_pretrained(str(src), dtype=torch.float32).eval()
    c = small.config
    config = type(c)(**{**c.to_dict(), "hidden_size": factor * c.hidden_size, "head_dim": c.head_dim,
                        "num_attention_heads": factor * c.num_attention_heads,
                        "num_key_value_heads": factor * c.num_key_value_heads,
                        "intermediate_size": factor * c.intermediate_size})
    torch.manual_seed(seed)  # the fresh heads' and units' input weights (their outputs start at zero)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    grow(model, small, new_layers=[])
    with safe_open(str(src / "model.safetensors"), "pt") as f:
        stored = f.get_slice(next(iter(f.keys()))).get_dtype()
    model.to({"F16": torch.float16, "BF16": torch.bfloat16}.get(stored, torch.float32))
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out) as tmp:
        model.save_pretrained(tmp, safe_serialization=True)
        config_file = Path(tmp) / "config.json"
        saved = json.loads(config_file.read_text())
        saved["dtype"] = "float32"  # a plain from_pretrained loads fp32, as the family's own configs say
        config_file.write_text(json.dumps(saved, indent=2) + "\n")
        for written in Path(tmp).iterdir():
            if written.name != "model.safetensors":
                os.replace(written, out / written.name)
        AutoTokenizer.from_pretrained(str(src)).save_pretrained(str(out))
        recipe = {"widened_from": os.path.relpath(src, out), "factor": factor, "seed": seed}
        (out / RECIPE).write_text(json.dumps(recipe, indent=2) + "\n")
        os.replace(Path(tmp) / "model.safetensors", out / "model.safetensors")


def build(folder) -> bool:
    """Write the model at ``folder`` if it is only a recipe (``grown.json``, no weights yet): a widened model
    is a function of a shipped one, so it is built where it runs rather than kept in git. True if built."""
    import json
    from pathlib import Path

    folder = Path(folder)
    if not (folder / RECIPE).exists() or (folder / "model.safetensors").exists():
        return False
    r = json.loads((folder / RECIPE).read_text())
    widen(folder / r["widened_from"], folder, r["factor"], r["seed"])
    return True


def build_missing(root) -> list:
    """``build`` every recipe under ``root`` (a family folder, or the models folder); the folders built."""
    from pathlib import Path

    return [recipe.parent for recipe in sorted(Path(root).glob(f"**/{RECIPE}")) if build(recipe.parent)]


def main(argv=None) -> None:
    import argparse

    ap = argparse.ArgumentParser(description="write a model widened by an integer factor (Net2Net): the same "
                                             "logits from factor^2 the weight bytes")
    ap.add_argument("src", nargs="?", help="a Llama-layout model folder")
    ap.add_argument("out", nargs="?", help="the folder to write")
    ap.add_argument("--factor", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--build", metavar="ROOT", help="instead: build every model under ROOT that is only a recipe")
    a = ap.parse_args(argv)
    if a.build:
        for out in build_missing(a.build):
            print(f"built {out}")
    elif a.src and a.out:
        widen(a.src, a.out, a.factor, a.seed)
    else:
        ap.error("give SRC and OUT, or --build ROOT")


if __name__ == "__main__":
    main()
