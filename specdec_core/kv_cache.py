"""Preallocated slot KV cache.

One buffer per layer of shape [slots, max_len + 1, kv_heads, head_dim], allocated once. A sequence
owns a slot; its length is a Python int. Writing new keys is an in-place scatter at each row's own
positions, rollback after a rejection is just lowering the length, and freeing a slot costs
nothing: no step ever concatenates or copies the whole cache (HF's DynamicCache does, which made
a batch-64 step at context 512 six times slower on these machines; docs/ARCHITECTURE.md (Facts)).

The extra column ``max_len`` is a trash column: padding tokens of a ragged batch write there and
no valid query ever attends to it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class StepLayout:
    """Where one batched forward reads and writes, shared by every layer of that forward."""

    slots: torch.Tensor  # [B] slot index of each row
    write_rows: torch.Tensor  # [B * Q] flat (slot, position) row of each new token (trash column for padding)
    kv_len: int  # columns attended this step: max over rows of (cached + new)
    contiguous_from: int | None  # slots == arange(start, start+B): read a view instead of gathering


class SlotKVCache:
    """Holds K/V for up to ``num_slots`` sequences of at most ``max_len`` tokens each.

    It is passed to HF decoder layers as their ``cache`` argument: each attention layer calls
    ``update`` with its new keys/values and gets back the keys/values it should attend to.
    """

    def __init__(
        self,
        num_layers: int,
        num_slots: int,
        num_kv_heads: int,
        head_dim: int,
        max_len: int,
        dtype: torch.dtype,
        device: torch.device | str,
    ):
        # Position-major layout: (slot, position) flattens to one row index, so writing a step's new
        # tokens is a single index_copy_; attention reads a transposed view.
        shape = (num_slots, max_len + 1, num_kv_heads, head_dim)
        self.keys = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.values = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.max_len = max_len
        self.num_slots = num_slots
        self.layout: StepLayout | None = None

    def storage_ptrs(self) -> list[int]:
        """Data pointers of every buffer: tests assert they never change (no reallocation)."""
        return [t.data_ptr() for t in self.keys + self.values]

    def update(self, key_states, value_states, layer_idx, kwargs=None):  # HF Cache protocol
        # key_states, value_states: [B, kv_heads, Q, head_dim] -> returns [B, kv_heads, kv_len, head_dim] views
        layout = self.layout
        k_buf, v_buf = self.keys[layer_idx], self.values[layer_idx]
        flat = (-1,) + k_buf.shape[2:]
        k_buf.view(flat).index_copy_(0, layout.write_rows, key_states.transpose(1, 2).reshape(flat).to(k_buf.dtype))
        v_buf.view(flat).index_copy_(0, layout.write_rows, value_states.transpose(1, 2).reshape(flat).to(v_buf.dtype))
        if layout.contiguous_from is not None:
            start = layout.contiguous_from
            end = start + layout.slots.shape[0]
            keys, values = k_buf[start:end, : layout.kv_len], v_buf[start:end, : layout.kv_len]
        else:
            keys = k_buf[:, : layout.kv_len].index_select(0, layout.slots)
            values = v_buf[:, : layout.kv_len].index_select(0, layout.slots)
        return keys.transpose(1, 2), values.transpose(1, 2)
