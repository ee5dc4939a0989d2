"""A lean decoder-layer stack for the plain Llama layout (llama, mistral without biases).

Same weights and the same math as HF's ``LlamaDecoderLayer`` (RMSNorm, RoPE, SDPA, SwiGLU), but
with q/k/v and gate/up fused into one matmul each (4 matmuls per layer instead of 7), each run by
the kernel that suits its token count (``linear.Projection``), and none of the per-module call
machinery. For small models on CPU that framework overhead is most of a step (docs/ARCHITECTURE.md, Facts: ~1.2 ms
per layer at batch 1), and it sets the draft/target cost ratio c. The original module parameters
are re-pointed at slices of the fused tensors, so the HF modules keep working on the same memory.
Each layer takes its own attention mask from the runner, so Mistral's sliding window holds here too.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from transformers import PreTrainedModel

from specdec_core.linear import Projection

FUSABLE_MODEL_TYPES = ("llama", "mistral")


def can_fuse(model: PreTrainedModel) -> bool:
    cfg = model.config
    return (
        cfg.model_type in FUSABLE_MODEL_TYPES
        and not getattr(cfg, "attention_bias", False)
        and not getattr(cfg, "mlp_bias", False)
        and getattr(cfg, "hidden_act", "silu") == "silu"
    )


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class FusedLlamaLayers:
    def __init__(self, model: PreTrainedModel):
        cfg = model.config
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        self.eps = cfg.rms_norm_eps
        self.scale = self.head_dim**-0.5
        # What one forward reads: each projection's kernel is probed on a working set this large.
        self.weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
        proj = functools.partial(Projection, model_bytes=self.weight_bytes)
        self.layers = []
        for layer in model.model.layers:
            attn, mlp = layer.self_attn, layer.mlp
            qkv = proj(torch.cat([attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight]))
            gate_up = proj(torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight]))
            o_proj, down = proj(attn.o_proj.weight), proj(mlp.down_proj.weight)
            share_weight(qkv, (attn.q_proj, attn.k_proj, attn.v_proj))
            share_weight(gate_up, (mlp.gate_proj, mlp.up_proj))
            share_weight(o_proj, (attn.o_proj,))
            share_weight(down, (mlp.down_proj,))
            self.layers.append((
                layer.input_layernorm.weight, qkv, o_proj, layer.post_attention_layernorm.weight, gate_up, down,
            ))

    def __call__(self, hidden, pos_emb, masks, cache, packed: PackedRows | None = None):
        # hidden: [B, Q, H] (packed: [1, T, H], the rows' tokens back to back); pos_emb: (cos, sin),
        # each [B, Q, head_dim] ([1, T, head_dim]); masks: one [B, 1, Q, kv_len] bool (or None: every
        # column) per layer, over the padded layout
        _, tokens, width = hidden.shape
        batch, q_len = (packed.batch, packed.q_len) if packed is not None else hidden.shape[:2]
        cos, sin = (t.unsqueeze(2) for t in pos_emb)  # [B, Q, 1, head_dim]
        gqa = self.num_kv_heads != self.num_heads
        heads, kv_heads, dim = self.num_heads, self.num_kv_heads, self.head_dim
        qk_width = (heads + kv_heads) * dim
        for idx, ((ln_attn, qkv, o_proj, ln_mlp, gate_up, down), mask) in enumerate(zip(self.layers, masks)):
            x = qkv(F.rms_norm(hidden, (width,), ln_attn, self.eps))  # [B, Q, (heads + 2 kv_heads) * D]
            # RoPE on queries and keys in one pass: they sit side by side in the fused output.
            qk = x[..., :qk_width].view(-1, tokens, heads + kv_heads, dim)
            qk = qk * cos + _rotate_half(qk) * sin
            q = qk[:, :, :heads]  # [B, Q, heads, D]
            k = qk[:, :, heads:].transpose(1, 2)  # [B, kv_heads, Q, D]
            v = x[..., qk_width:].view(-1, tokens, kv_heads, dim).transpose(1, 2)
            keys, values = cache.update(k, v, idx)  # [B, kv_heads, kv_len, D]
            if packed is not None:
                q = packed.pad(q[0])
            q = q.transpose(1, 2)  # [B, heads, Q, D]
            if q_len == 1:
                attn = decode_attention(q, keys, values, mask, self.scale)
            elif packed is not None and packed.wide is not None:
                attn = ragged_attention(q, keys, values, mask, self.scale, packed.narrow, packed.wide, gqa)
            else:
                attn = attention(q, keys, values, mask, self.scale, gqa)
            attn = attn.transpose(1, 2).reshape(batch, q_len, -1)  # [B, Q, heads * D]
            if packed is not None:
                attn = packed.unpad(attn)
            hidden = hidden + o_proj(attn)
            gate, up = gate_up(F.rms_norm(hidden, (width,), ln_mlp, self.eps)).chunk(2, dim=-1)
            hidden = hidden + down(F.silu(gate) * up)
        return hidden


@dataclass(frozen=True)
class PackedRows:
    """A forward whose rows feed different numbers of tokens, run packed: every projection over the
    T real tokens back to back ([1, T, ...]), attention alone over the rows padded to the widest
    (``batch`` x ``q_len``: masks and the cache's per-row views are per row). In a compute-bound
    verify the projections are the cost, so a row pays for its own width, not the widest row's."""

    batch: int
    q_len: int
    padded_index: torch.Tensor  # [T]: each real token's place in the padded [batch * q_len] layout
    # Rows wider than ``narrow`` tokens, attended one by one beside the others padded to ``narrow``
    # (None: the whole batch padded to ``q_len`` at once)
    wide: tuple[int, ...] | None
    narrow: int = 1

    def pad(self, x: torch.Tensor) -> torch.Tensor:  # [T, ...] -> [batch, q_len, ...], zeros in the padding
        out = x.new_zeros((self.batch * self.q_len,) + x.shape[1:])
        out.index_copy_(0, self.padded_index, x)
        return out.view((self.batch, self.q_len) + x.shape[1:])

    def unpad(self, x: torch.Tensor) -> torch.Tensor:  # [batch, q_len, F] -> [1, T, F]
        return x.reshape(self.batch * self.q_len, -1).index_select(0, self.padded_index).unsqueeze(0)


def decode_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor | None,
                     scale: float) -> torch.Tensor:
    """Attention of one new token per row: per (row, head), two matrix-vector products over its block.

    q: [B, heads, 1, D]; keys, values: [B, kv_heads, T, D] (views of the head-major cache, each
    [T, D] block contiguous); mask: [B, 1, 1, T] bool or None.
    Decode attention is a read of the cache, cold from DRAM at any batch worth batching, and the
    BLAS matrix-vector product streams each block at ~17 GB/s where SDPA's CPU kernel reached
    ~5-12 and broadcast products over a position-major cache 1.5-6 (8 layers, batch 8: 3.2 against
    10.8 ms at context 128, 35 against 401 at 2000; docs/ARCHITECTURE.md, Facts: "Decode attention").
    A query group of GQA shares its block: the products run [group, D] x [D, T].
    """
    batch, heads, _, dim = q.shape
    kv_heads = keys.shape[1]
    qg = q.reshape(batch, kv_heads, heads // kv_heads, dim)  # [B, kv, g, D]
    scores = torch.matmul(qg, keys.transpose(-1, -2)) * scale  # [B, kv, g, T]
    if mask is not None:
        scores = scores.masked_fill(~mask.reshape(batch, 1, 1, -1), float("-inf"))
    out = torch.matmul(torch.softmax(scores, dim=-1), values)  # [B, kv, g, D]
    return out.reshape(batch, heads, 1, dim)


def ragged_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, scale: float,
                     narrow: int, wide: tuple[int, ...], gqa: bool) -> torch.Tensor:
    """Attention of a batch whose rows mostly query at most ``narrow`` tokens and a few (``wide``)
    more: every row's first ``narrow`` queries at once (``decode_attention`` for one), then each wide
    row alone, on views of its own cache (no copy). Decode rows beside a prefill are the case: padded
    to the prompt's width, a batch of K=4 rows paid the prompt's queries each.

    q: [B, heads, Q, D] padded; keys, values: [B, kv_heads, T, D]; mask: [B, 1, Q, T] bool.
    Gathering the wide rows' caches for one call instead copied each one's keys and values every
    layer: ~0.1 ms a row and layer at context 150 (a third of a batch-8 step's attention).
    """
    if narrow == 1:
        out = decode_attention(q[:, :, :1], keys, values, mask[:, :, :1], scale)  # [B, heads, 1, D]
    else:
        out = attention(q[:, :, :narrow], keys, values, mask[:, :, :narrow], scale, gqa)  # [B, heads, narrow, D]
    out = F.pad(out, (0, 0, 0, q.shape[2] - narrow))  # [B, heads, Q, D]: the narrow rows' padding is never read
    for row in wide:
        at = slice(row, row + 1)
        out[at] = attention(q[at], keys[at], values[at], mask[at], scale, gqa)
    return out


# Widest query a row may have for ``small_query_attention``; wider (a prefill) goes to SDPA.
SMALL_QUERY = 16


def attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor | None, scale: float,
              gqa: bool) -> torch.Tensor:
    """q: [B, heads, Q, D] against the cache's views: batched products for a verify's few queries,
    SDPA for a prefill's many."""
    if q.shape[2] <= SMALL_QUERY:
        return small_query_attention(q, keys, values, mask, scale)
    return F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, scale=scale, enable_gqa=gqa)


def small_query_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor | None,
                          scale: float) -> torch.Tensor:
    """Attention of a few query tokens per row (a verify): ``decode_attention``'s batched products,
    a head group's queries at every position stacked against its block.

    q: [B, heads, Q, D]; keys, values: [B, kv_heads, T, D]; mask: [B, 1, Q, T] bool or None.
    A verify reads the cache once, as a decode step does; SDPA's CPU kernel with a mask took 1.4-1.6x
    as long at Q = 2-9 (batch 8, 18 heads x 32, context 150-600: 0.29 against 0.17-0.18 ms a layer at Q = 2).
    """
    batch, heads, q_len, dim = q.shape
    kv_heads = keys.shape[1]
    group = heads // kv_heads
    qg = (q * scale).reshape(batch, kv_heads, group * q_len, dim)  # [B, kv, g * Q, D]
    scores = torch.matmul(qg, keys.transpose(-1, -2))  # [B, kv, g * Q, T]
    if mask is not None:
        scores = scores.view(batch, kv_heads, group, q_len, -1).masked_fill_(~mask.unsqueeze(2), float("-inf"))
    out = torch.matmul(torch.softmax(scores.view(batch, kv_heads, group * q_len, -1), dim=-1), values)
    return out.view(batch, heads, q_len, dim)  # [B, kv, g * Q, D] is [B, heads, Q, D] head-major


def share_weight(projection: Projection, modules) -> None:
    """Point each module's weight at its rows of the projection's weight (views, no copy)."""
    start = 0
    for module in modules:
        rows = module.weight.shape[0]
        module.weight = torch.nn.Parameter(projection.weight[start : start + rows], requires_grad=False)
        start += rows
