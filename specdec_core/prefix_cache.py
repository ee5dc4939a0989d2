"""Automatic prefix caching for the slot KV cache: vLLM's automatic prefix caching, by blocks.

A released sequence's full blocks of ``block_size`` tokens are copied out of its slot into a bounded
store, each keyed by (the block before it, the block's own tokens). A block is found only through
the exact tokens before it, so a hit is the same context, compared token for token (no hash can
collide). A new sequence whose history starts with stored blocks gets them copied into its slot and
feeds only the rest: a token's K/V depend only on the tokens before it, so the copy is the prefill it
skips (up to the float rounding any other batch shape gives it too).

The store is separate from the slots, so a prompt outlives the slot that computed it (a freed slot
is taken by the next request at once), and its copies cost a memcpy: the served target's 40-token
prompt is ~1.5 MB of K/V, against a 40-token prefill of ~60 ms on this CPU.

Eviction is least recently used. A block whose parent was evicted can no longer be reached and ages
out the same way. A bounded (``KVWindow``) cache keeps no prefixes: its columns are a ring.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import torch

ROOT = 0  # the parent id of a sequence's first block


@dataclass
class _Block:
    key: tuple[int, tuple[int, ...]]  # (parent block id, its tokens)
    row: int  # its row in the store's tensors


class PrefixCache:
    """Up to ``capacity_tokens`` tokens of K/V, in blocks of ``block_size``, for every layer."""

    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, capacity_tokens: int,
                 dtype: torch.dtype, device: torch.device | str, block_size: int = 16):
        if block_size < 1 or capacity_tokens < block_size:
            raise ValueError(f"a prefix cache needs block_size >= 1 and room for one block, got "
                             f"{capacity_tokens} tokens in blocks of {block_size}")
        self.block_size = block_size
        self.capacity = capacity_tokens // block_size
        shape = (self.capacity, num_kv_heads, block_size, head_dim)
        self.keys = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.values = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self._ids: dict[tuple[int, tuple[int, ...]], int] = {}
        self._blocks: OrderedDict[int, _Block] = OrderedDict()  # least recently used first
        self._free_rows = list(range(self.capacity))
        self._next_id = ROOT + 1  # ids are never reused: a child of an evicted block stays unreachable
        self.hit_tokens = 0
        self.looked_up_tokens = 0

    def __len__(self) -> int:
        return len(self._blocks)

    def stats(self) -> dict:
        """Counters as vLLM's prefix cache metrics have them: tokens looked up, tokens found."""
        return {"looked_up_tokens": self.looked_up_tokens, "hit_tokens": self.hit_tokens, "blocks": len(self),
                "capacity_blocks": self.capacity, "block_size": self.block_size}

    def _chain(self, tokens: list[int]) -> list[int]:
        """Ids of the stored blocks that start ``tokens``, in order (each marked recently used)."""
        parent, found, size = ROOT, [], self.block_size
        for start in range(0, len(tokens) - size + 1, size):
            block_id = self._ids.get((parent, tuple(tokens[start:start + size])))
            if block_id is None:
                break
            self._blocks.move_to_end(block_id)
            found.append(block_id)
            parent = block_id
        return found

    def restore(self, tokens: list[int], keys: list[torch.Tensor], values: list[torch.Tensor], slot: int) -> int:
        """Copy the stored blocks that start ``tokens`` into ``slot`` of a slot cache's per-layer buffers
        ([slots, kv_heads, positions, D]); returns how many tokens they hold (0: none stored)."""
        chain = self._chain(tokens)
        self.looked_up_tokens += len(tokens)
        if not chain:
            return 0
        n = len(chain) * self.block_size
        rows = torch.tensor([self._blocks[b].row for b in chain], device=keys[0].device)
        for dst, src in ((keys, self.keys), (values, self.values)):
            for layer_dst, layer_src in zip(dst, src):
                blocks = layer_src.index_select(0, rows)  # [n_blocks, kv_heads, block, D]
                layer_dst[slot, :, :n] = blocks.transpose(0, 1).reshape(blocks.shape[1], n, blocks.shape[3])
        self.hit_tokens += n
        return n

    def store(self, tokens: list[int], keys: list[torch.Tensor], values: list[torch.Tensor], slot: int) -> None:
        """Keep the full blocks of ``tokens``, whose K/V sit at positions 0.. of ``slot``."""
        parent, size = ROOT, self.block_size
        for depth, start in enumerate(range(0, len(tokens) - size + 1, size)):
            key = (parent, tuple(tokens[start:start + size]))
            block_id = self._ids.get(key)
            if block_id is not None:
                self._blocks.move_to_end(block_id)
            else:
                if depth >= self.capacity:  # evicting further would take this chain's own blocks
                    return
                block_id = self._add(key)
                row = self._blocks[block_id].row
                for dst, src in ((self.keys, keys), (self.values, values)):
                    for layer_dst, layer_src in zip(dst, src):
                        layer_dst[row] = layer_src[slot, :, start:start + size]
            parent = block_id

    def _add(self, key: tuple[int, tuple[int, ...]]) -> int:
        if not self._free_rows:
            _, oldest = self._blocks.popitem(last=False)
            del self._ids[oldest.key]
            self._free_rows.append(oldest.row)
        block_id, self._next_id = self._next_id, self._next_id + 1
        self._ids[key] = block_id
        self._blocks[block_id] = _Block(key, self._free_rows.pop())
        return block_id
