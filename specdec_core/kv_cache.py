"""Preallocated slot KV cache.

One buffer per layer of shape [slots, kv_heads, max_len + 1, head_dim], allocated once. A sequence
owns a slot; its length is a Python int. Writing new keys is an in-place scatter at each row's own
positions, rollback after a rejection is just lowering the length, and freeing a slot costs
nothing: no step ever concatenates or copies the whole cache (HF's DynamicCache does, which made
a batch-64 step at context 512 six times slower on these machines; docs/ARCHITECTURE.md (Facts)).

The extra column ``max_len`` is a trash column: padding tokens of a ragged batch write there and
no valid query ever attends to it.

A draft's cache may instead be bounded (``KVWindow``): StreamingLLM's attention sinks and a recent
window (Xiao et al. 2024), the draft MagicDec pairs with a long-context target (Chen et al. 2024):
its per-step read and its memory stop growing with the context, and the target's verification
keeps the output exact whatever the draft saw.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class StepLayout:
    """Where one batched forward reads and writes, shared by every layer of that forward."""

    slots: torch.Tensor  # [B] slot index of each row
    write_rows: torch.Tensor  # [N] flat (slot, position) row of each new token (trash column for padding)
    kv_len: int  # columns attended this step: max over rows of (cached + new)
    contiguous_from: int | None  # slots == arange(start, start+B): read a view instead of gathering


@dataclass(frozen=True)
class KVWindow:
    """Positions a bounded cache keeps per slot: the first ``sinks`` and the last ``window``.

    They sit in ``columns`` = sinks + window + slack columns, the non-sink positions in a ring; the
    slack is what one forward may add without overwriting a column one of its own queries still
    sees (a draft feeds 1-3 tokens a step; a longer feed loses its oldest window columns early).
    """

    sinks: int
    window: int
    slack: int = 32

    def __post_init__(self) -> None:
        if self.sinks < 0 or self.window < 1 or self.slack < 0:
            raise ValueError(f"KVWindow needs sinks >= 0, window >= 1, slack >= 0: {self}")

    @property
    def columns(self) -> int:
        return self.sinks + self.window + self.slack

    def column(self, position: int) -> int:
        if position < self.sinks:
            return position
        return self.sinks + (position - self.sinks) % (self.window + self.slack)

    def kept(self, length: int, n: int) -> list[int]:
        """The positions of a feed of ``n`` tokens after ``length`` that are computed at all: a feed
        longer than the window (a prefill) keeps its sink positions and its last ``window`` tokens,
        the only ones any later query sees."""
        end = length + n
        if n <= self.window:
            return list(range(length, end))
        sinks = range(length, min(self.sinks, end))
        return list(sinks) + list(range(max(end - self.window, self.sinks, length), end))


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
        window: KVWindow | None = None,
    ):
        # Head-major layout: each (slot, head) owns one contiguous [max_len + 1, head_dim] block, the
        # operand a one-token attention streams as a matrix-vector product. Position-major rows
        # ([slot, position, heads, D]) made that read a strided walk: 3.4x slower over 8 layers at batch
        # 8 and context 128, 11x at 2000 (docs/ARCHITECTURE.md, Facts: "Decode attention").
        shape = (num_slots, num_kv_heads, max_len + 1, head_dim)
        self.keys = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.values = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.max_len = max_len
        self.num_slots = num_slots
        self.num_kv_heads = num_kv_heads
        self.layout: StepLayout | None = None
        self.window = window
        # A bounded cache's position in each column (-1: empty), for the attention mask: a column's
        # position changes as the ring turns, and a rolled-back column keeps a stale one.
        self.column_positions = (torch.full((num_slots, max_len), -1, dtype=torch.long, device=device)
                                 if window is not None else None)
        self._write_index: torch.Tensor | None = None  # [N * kv_heads] flat buffer row of each new (token, head)

    def storage_ptrs(self) -> list[int]:
        """Data pointers of every buffer: tests assert they never change (no reallocation)."""
        return [t.data_ptr() for t in self.keys + self.values]

    def clear(self, slot: int) -> None:
        """Forget a slot's positions (a bounded cache: before another sequence owns the slot)."""
        if self.column_positions is not None:
            self.column_positions[slot] = -1

    def record(self, slots: list[int], positions: list[int]) -> None:
        """Note the positions a bounded cache's next forward writes (token by token: its slot and position)."""
        flat = [slot * self.max_len + self.window.column(p) for slot, p in zip(slots, positions)]
        dev = self.column_positions.device
        self.column_positions.view(-1)[torch.tensor(flat, device=dev)] = torch.tensor(positions, device=dev)

    def window_mask(self, slots: torch.Tensor, query_positions: torch.Tensor, kv_len: int) -> torch.Tensor:
        """[B, 1, Q, kv_len] bool: which of a bounded cache's columns each query sees (its sinks and the
        last ``window`` positions up to its own). slots: [B]; query_positions: [B, Q]."""
        cols = self.column_positions.index_select(0, slots)[:, :kv_len].unsqueeze(1)  # [B, 1, kv_len]
        rows = query_positions.unsqueeze(2)  # [B, Q, 1]
        window = self.window
        seen = (cols >= 0) & (cols <= rows) & ((cols < window.sinks) | (cols > rows - window.window))
        return seen.unsqueeze(1)

    def begin(self, layout: StepLayout) -> None:
        """Set the layout every layer of the next forward shares (``end`` clears it)."""
        row_len = self.max_len + 1
        rows = layout.write_rows  # slot * row_len + position -> that token's row in head 0's block
        head0 = rows + (rows // row_len) * ((self.num_kv_heads - 1) * row_len)
        heads = torch.arange(self.num_kv_heads, device=rows.device) * row_len
        self._write_index = (head0.unsqueeze(1) + heads).flatten()  # [N * kv_heads], token-major
        self.layout = layout

    def end(self) -> None:
        self.layout, self._write_index = None, None

    def update(self, key_states, value_states, layer_idx, kwargs=None):  # HF Cache protocol
        # key_states, value_states: [B, kv_heads, Q, head_dim] -> returns [B, kv_heads, kv_len, head_dim] views
        layout = self.layout
        k_buf, v_buf = self.keys[layer_idx], self.values[layer_idx]
        dim = k_buf.shape[-1]
        # [B, kv, Q, D] -> [B * Q * kv, D]: token-major, head-minor, the order of _write_index
        for buf, states in ((k_buf, key_states), (v_buf, value_states)):
            buf.view(-1, dim).index_copy_(0, self._write_index, states.transpose(1, 2).reshape(-1, dim).to(buf.dtype))
        if layout.contiguous_from is not None:
            start = layout.contiguous_from
            end = start + layout.slots.shape[0]
            return k_buf[start:end, :, : layout.kv_len], v_buf[start:end, :, : layout.kv_len]
        keys = k_buf[:, :, : layout.kv_len].index_select(0, layout.slots)
        values = v_buf[:, :, : layout.kv_len].index_select(0, layout.slots)
        return keys, values
