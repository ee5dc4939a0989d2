"""Net2Net growth (Chen et al. 2016) of a pre-norm Llama: a wider, deeper model that computes exactly the
smaller one's logits, to be trained further (``modelzoo.train``, spec ``grow_from``)."""
from __future__ import annotations


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
    - tied embedding: tiled, and the final norm divided by r, since logits sum over the r copies.
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
