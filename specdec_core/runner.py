"""Model runner: an HF causal LM driven step by step over a preallocated slot KV cache.

The runner loads any local or hub checkpoint with the real ``AutoModelForCausalLM.from_pretrained``
and runs the model's own modules (embedding, rotary embedding, decoder layers, norm, LM head), but
owns the batching: one forward takes many sequences, each feeding its own number of new tokens
(1 for a plain step, p pending + K draft tokens for a verify, a whole prompt for a prefill) at its
own position. Rows only ever attend to their own slot, so concurrent sequences never see each
other's state.

Every layer attends as the family's transformers model has it attend: full causal, or a sliding
window of the last W positions, through a per-layer mask (the cache keeps every position; a window
only hides the old ones). A checkpoint whose config asks for something this does not reproduce
(another RoPE type, logit soft-capping, an unknown layer type) is refused at load instead of run wrong.
"""

from __future__ import annotations

import heapq
import itertools
import statistics
import time

import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel

from specdec_core.fused_llama import FusedLlamaLayers, PackedRows, can_fuse, share_weight
from specdec_core.kv_cache import KVWindow, SlotKVCache, StepLayout
from specdec_core.linear import Projection
from specdec_core.prefix_cache import PrefixCache

# Decoder-only families whose base model is embed -> rotary -> layers(cache=...) -> norm -> lm_head,
# the structure this runner drives directly.
SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "granite", "olmo2", "smollm3")
# RoPE variants whose cos/sin depend on the position alone, so one table serves every row of every
# forward. "dynamic" is one here: it rescales only past max_position_embeddings, which max_len never
# exceeds. "longrope" is not: it switches factors on the longest sequence of a forward, which a batch
# of requests at different lengths cannot reproduce per request.
POSITION_ONLY_ROPE_TYPES = ("default", "linear", "llama3", "yarn", "dynamic")
# The families whose transformers model picks each layer's mask by config.layer_types.
LAYER_TYPES_FAMILIES = ("qwen2", "qwen3", "smollm3")
LAYER_TYPES = ("full_attention", "sliding_attention")
# Rows of different widths attend padded to the widest (every row pays the widest row's queries) or one
# wide row at a time beside the others padded to a narrower width (``fused_llama.ragged_attention``), whose
# call per row costs about this many padded queries (batch 8, 18 heads x 32: 0.065-0.09 ms a layer; 17
# queries' worth at context 150, 7 at 600). Each forward takes the cheapest (``attention_split``).
ROW_CALL_QUERIES = 12


def attention_split(q: list[int]) -> tuple[tuple[int, ...] | None, int]:
    """(rows attended one by one, the width the others are padded to) for a forward whose rows feed
    ``q`` tokens each, at the fewest padded queries; (None, widest): the whole batch padded at once."""
    batch, q_max = len(q), max(q)
    best, split = batch * q_max, (None, q_max)
    for narrow in sorted(set(q))[:-1]:
        wide = tuple(b for b, n in enumerate(q) if n > narrow)
        cost = batch * narrow + len(wide) * (ROW_CALL_QUERIES + q_max)
        if cost < best:
            best, split = cost, (wide, narrow)
    return split


def default_device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def default_dtype(device: torch.device) -> torch.dtype:
    # bf16 halves memory traffic on GPU; on CPU fp32 is both faster and exact enough.
    return torch.bfloat16 if device.type == "cuda" else torch.float32


def load_tokenizer(path: str, trust_remote_code: bool = False):
    return AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)


def layer_types(cfg) -> list[str]:
    """Each layer's attention kind, as the family's transformers model picks its mask.

    | family                 | sliding layers                                      |
    |------------------------|-----------------------------------------------------|
    | mistral                | all, when sliding_window is set (no layer_types)    |
    | qwen2, qwen3, smollm3  | those layer_types marks "sliding_attention"         |
    | llama, granite, olmo2  | none: their models never build a sliding mask       |
    """
    n = cfg.num_hidden_layers
    if cfg.model_type == "mistral":
        return ["sliding_attention" if cfg.sliding_window is not None else "full_attention"] * n
    if cfg.model_type in LAYER_TYPES_FAMILIES:
        return list(cfg.layer_types)
    return ["full_attention"] * n


def unsupported_features(model: PreTrainedModel) -> list[str]:
    """What of a supported family's config the runner would not reproduce exactly; empty if nothing."""
    cfg = model.config
    found = []
    rope_type = model.model.rotary_emb.rope_type
    if rope_type not in POSITION_ONLY_ROPE_TYPES:
        found.append(f"rope_type {rope_type!r} (supported: {', '.join(POSITION_ONLY_ROPE_TYPES)})")
    for name in ("attn_logit_softcapping", "final_logit_softcapping"):
        if getattr(cfg, name, None) is not None:
            found.append(f"{name}={getattr(cfg, name)} (logit soft-capping)")
    types = layer_types(cfg)
    unknown = sorted(set(types) - set(LAYER_TYPES))
    if unknown:
        found.append(f"layer_types {unknown} (supported: {', '.join(LAYER_TYPES)})")
    if "sliding_attention" in types and cfg.sliding_window is None:
        found.append("sliding_attention layers without a sliding_window")
    return found


class ModelRunner:
    """Batched, ragged forward steps for one model over its own slot KV cache."""

    def __init__(self, model: PreTrainedModel, max_slots: int = 32, max_len: int = 1024, name: str = "model",
                 kv_window: KVWindow | None = None, prefix_cache_tokens: int = 0):
        model_type = getattr(model.config, "model_type", None)
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(
                f"model type {model_type!r} is not supported by the runner; supported: {SUPPORTED_MODEL_TYPES}"
            )
        unsupported = unsupported_features(model)
        if unsupported:
            raise ValueError(
                f"{name}: {model_type} config features the runner does not support: {'; '.join(unsupported)}"
            )
        self.model = model.eval()
        self.name = name
        self.device = next(model.parameters()).device
        self.dtype = next(model.parameters()).dtype
        base = model.model
        self._embed, self._rotary, self._layers, self._norm = (
            base.embed_tokens, base.rotary_emb, base.layers, base.norm
        )
        # Plain Llama layouts run a fused, lean layer stack; other families run HF's own layers.
        self._fused = FusedLlamaLayers(model) if can_fuse(model) else None
        self._lm_head = model.lm_head
        if self._fused is not None:
            self._lm_head = Projection(model.lm_head.weight, model_bytes=self._fused.weight_bytes)
            tied = model.lm_head.weight is self._embed.weight
            share_weight(self._lm_head, (model.lm_head,))
            if tied:  # keep the tie: the embedding reads the same memory
                self._embed.weight = model.lm_head.weight
        cfg = model.config
        # Each layer's sliding window (None: full causal attention), and the distinct windows to mask for.
        self._windows = [cfg.sliding_window if t == "sliding_attention" else None for t in layer_types(cfg)]
        self._sliding = sorted(set(self._windows) - {None})
        # Granite scales outside its modules: embeddings up in GraniteModel, logits down in GraniteForCausalLM.
        granite = model_type == "granite"
        self._embedding_multiplier = cfg.embedding_multiplier if granite else 1.0
        self._logits_scaling = cfg.logits_scaling if granite else 1.0
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        kv_heads = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
        max_positions = getattr(cfg, "max_position_embeddings", max_len)
        self.max_len = min(max_len, max_positions)
        # Every accepted RoPE variant depends on the position only: look cos/sin up instead of
        # recomputing them every forward (HF's rotary module is ~45 us of a ~0.8 ms draft step on CPU).
        positions = torch.arange(self.max_len, device=self.device).unsqueeze(0)
        cos, sin = self._rotary(torch.empty(0, dtype=self.dtype, device=self.device), positions)
        self._rope_table = (cos[0], sin[0])  # each [max_len, head_dim]
        # A bounded cache (a draft's, ``KVWindow``) holds its columns whatever the context; positions
        # still run to max_len.
        columns = min(kv_window.columns, self.max_len) if kv_window is not None else self.max_len
        self.cache = SlotKVCache(
            cfg.num_hidden_layers, max_slots, kv_heads, head_dim, columns, self.dtype, self.device, window=kv_window
        )
        self.vocab_size = model.lm_head.out_features
        self.num_layers = cfg.num_hidden_layers
        self.num_params = sum(p.numel() for p in model.parameters())
        self._lengths = [0] * max_slots
        self._free = list(range(max_slots))  # a heap: lowest slot first keeps batches contiguous
        # Released sequences' K/V by blocks, for the next sequence that starts the same way (a
        # bounded cache's columns are a ring: it keeps none).
        self.prefix_cache = (PrefixCache(self.num_layers, kv_heads, head_dim, prefix_cache_tokens, self.dtype,
                                         self.device) if prefix_cache_tokens and kv_window is None else None)

    @classmethod
    def from_pretrained(
        cls,
        path: str,
        *,
        device: str | torch.device | None = None,
        dtype: str | torch.dtype | None = None,
        max_slots: int = 32,
        max_len: int = 1024,
        trust_remote_code: bool = False,
        kv_window: KVWindow | None = None,
        prefix_cache_tokens: int = 0,
    ) -> ModelRunner:
        device = torch.device(device) if device is not None else default_device()
        if isinstance(dtype, str):
            dtype = getattr(torch, dtype)
        dtype = dtype or default_dtype(device)
        model = AutoModelForCausalLM.from_pretrained(
            path, dtype=dtype, trust_remote_code=trust_remote_code, attn_implementation="sdpa"
        ).to(device)
        return cls(model, max_slots=max_slots, max_len=max_len, name=str(path), kv_window=kv_window,
                   prefix_cache_tokens=prefix_cache_tokens)

    # ---- slots -------------------------------------------------------------------------------

    @property
    def num_free_slots(self) -> int:
        return len(self._free)

    @property
    def num_slots(self) -> int:
        return self.cache.num_slots

    def allocate(self) -> int:
        if not self._free:
            raise RuntimeError(f"{self.name}: all {self.cache.num_slots} KV slots are in use")
        slot = heapq.heappop(self._free)
        self._lengths[slot] = 0
        self.cache.clear(slot)
        return slot

    def free(self, slot: int) -> None:
        if slot in self._free:
            raise RuntimeError(f"{self.name}: slot {slot} freed twice")
        self._lengths[slot] = 0
        heapq.heappush(self._free, slot)

    def length(self, slot: int) -> int:
        return self._lengths[slot]

    def reuse_prefix(self, slot: int, tokens: list[int]) -> int:
        """Fill an empty slot with the longest stored prefix of ``tokens`` (``PrefixCache``); returns
        its length, the tokens the slot now holds (0 without a prefix cache or a stored prefix)."""
        if self.prefix_cache is None or self._lengths[slot]:
            return 0
        n = self.prefix_cache.restore(tokens, self.cache.keys, self.cache.values, slot)
        self._lengths[slot] = n
        return n

    def keep_prefix(self, slot: int, tokens: list[int]) -> None:
        """Store the full blocks of ``tokens``, the slot's cached tokens, before the slot is freed."""
        if self.prefix_cache is not None:
            self.prefix_cache.store(tokens[: self._lengths[slot]], self.cache.keys, self.cache.values, slot)

    def truncate(self, slot: int, length: int) -> None:
        """Roll a sequence back to ``length`` cached tokens (after a rejection)."""
        if not 0 <= length <= self._lengths[slot]:
            raise ValueError(f"cannot truncate slot {slot} of length {self._lengths[slot]} to {length}")
        self._lengths[slot] = length

    # ---- forward -----------------------------------------------------------------------------

    @torch.inference_mode()
    def forward(
        self,
        slots: list[int],
        new_tokens: list[list[int]],
        num_logits: list[int],
    ) -> torch.Tensor:  # [B, max(num_logits), V] float32
        """Append ``new_tokens[b]`` to sequence ``slots[b]`` and return logits at its last ``num_logits[b]``
        positions (right-padded by repeating the last position)."""
        batch = len(slots)
        fed = [len(t) for t in new_tokens]  # tokens each row appends (its length grows by this)
        if batch == 0 or min(fed) == 0:
            raise ValueError("every row of a forward must feed at least one token")
        lengths = [self._lengths[s] for s in slots]
        for slot, length, n in zip(slots, lengths, fed):
            if length + n > self.max_len:
                raise ValueError(f"{self.name}: slot {slot} would exceed max_len {self.max_len}")
        window = self.cache.window
        # [B][n_b]: the positions each row computes: all it feeds, or a bounded cache's kept ones.
        rows = [window.kept(length, n) if window is not None else range(length, length + n)
                for length, n in zip(lengths, fed)]
        if window is not None:
            new_tokens = [[toks[p - length] for p in row] for toks, row, length in zip(new_tokens, rows, lengths)]
        q = [len(row) for row in rows]
        q_max = max(q)
        dev = self.device
        # Rows of different widths (a verify at each row's own K, prefills beside decodes) run packed
        # on the fused stack: its projections see only the real tokens, never the padding to the widest
        # row (ragged verification: a plain row among K=4 rows costs one token, not five). HF's layers
        # take a [B, Q] batch: padded.
        packed = self._fused is not None and min(q) != q_max
        row_len = self.cache.max_len + 1  # a slot's rows in the flat cache, trash column included
        column = window.column if window is not None else int
        # Index data is built in Python and sent as one tensor each: a forward runs in ~0.5-2 ms
        # here, and every small tensor op it saves is ~2 us.
        # [B][Q]: padding repeats its row's last position, so its query sees a non-empty sliding window
        # and looks up a RoPE row inside the table.
        positions = [[row[min(c, len(row) - 1)] for c in range(q_max)] for row in rows]
        if packed:
            write_rows = [slot * row_len + column(p) for slot, row in zip(slots, rows) for p in row]
            ids = torch.tensor([[t for toks in new_tokens for t in toks]], device=dev)  # [1, T]
            token_positions = torch.tensor([[p for row in rows for p in row]], device=dev)  # [1, T]
            # [T]: each real token's place in the padded [B * Q] layout attention runs in
            padded_index = torch.tensor([b * q_max + c for b, n in enumerate(q) for c in range(n)], device=dev)
        else:
            write_rows = [
                slot * row_len + (column(pos) if c < n else self.cache.max_len)  # padding: the trash column
                for slot, n, row in zip(slots, q, positions) for c, pos in enumerate(row)
            ]
            ids = torch.tensor([list(toks) + [0] * (q_max - len(toks)) for toks in new_tokens], device=dev)  # [B, Q]
        positions_t = torch.tensor(positions, device=dev)  # [B, Q]
        kv_len = max(length + n for length, n in zip(lengths, fed))
        slots_t = torch.tensor(slots, device=dev)
        if window is not None:  # every column it holds, once the ring has turned
            kv_len = min(kv_len, self.cache.max_len)
            self.cache.record([slot for slot, row in zip(slots, rows) for _ in row], [p for row in rows for p in row])
            masks = [self.cache.window_mask(slots_t, positions_t, kv_len)] * self.num_layers
        else:
            masks = self._layer_masks(positions_t, kv_len, ragged=q_max > 1 or min(lengths) != max(lengths))
        start = slots[0]
        contiguous = slots == list(range(start, start + batch))
        self.cache.begin(StepLayout(
            slots=slots_t,
            write_rows=torch.tensor(write_rows, device=dev),
            kv_len=kv_len,
            contiguous_from=start if contiguous else None,
        ))
        # The fused stack's embedding is a plain lookup: skip the module call.
        hidden = F.embedding(ids, self._embed.weight) if self._fused is not None else self._embed(ids)  # [B, Q, H]
        if self._embedding_multiplier != 1.0:
            hidden = hidden * self._embedding_multiplier
        rope_at = token_positions if packed else positions_t
        pos_emb = (self._rope_table[0][rope_at], self._rope_table[1][rope_at])
        if self._fused is not None:
            layout = PackedRows(batch, q_max, padded_index, *attention_split(q)) if packed else None
            hidden = self._fused(hidden, pos_emb, masks, self.cache, layout)  # [1, T, H] when packed
        else:
            for layer, mask in zip(self._layers, masks):
                hidden = layer(
                    hidden, attention_mask=mask, position_ids=positions_t, cache=self.cache, position_embeddings=pos_emb
                )
                if isinstance(hidden, tuple):
                    hidden = hidden[0]
        self.cache.end()
        for slot, n in zip(slots, fed):
            self._lengths[slot] += n
        if packed:
            return self._packed_logits(hidden[0], q, num_logits)
        return self._logits(hidden, q, num_logits)

    def kernel_bands(self) -> dict[str, range | None]:
        """Per projection of the fused stack, the token rows where it takes the packed kernel, as probed in
        this process (``linear.packed_rows``; every layer has the same shapes): what to compare when one
        process's steps run slower than another's on the same host. Empty off the fused stack."""
        if self._fused is None:
            return {}
        _, qkv, o_proj, _, gate_up, down = self._fused.layers[0]
        return {"qkv": qkv.packed_band, "o_proj": o_proj.packed_band, "gate_up": gate_up.packed_band,
                "down": down.packed_band, "lm_head": self._lm_head.packed_band}

    def _layer_masks(self, positions: torch.Tensor, kv_len: int, ragged: bool) -> list[torch.Tensor | None]:
        # positions: [B, Q] -> per layer, a [B, 1, Q, kv_len] bool mask, or None: attend to every column.
        # A query at position t sees its own cache columns 0..t: causal within the row, nothing of
        # other rows. One new token per row at a common length sees every column: no mask.
        # A sliding layer of window W sees only columns t-W+1..t, its own included: transformers'
        # sliding_window_overlay (kv_idx > q_idx - W) over the W-1 past tokens its sliding cache keeps.
        # Until a step reaches column W nothing falls out of a window: such layers attend like full ones.
        sliding = [w for w in self._sliding if kv_len > w]
        if not ragged and not sliding:
            return [None] * self.num_layers
        cols = torch.arange(kv_len, device=positions.device).view(1, 1, 1, -1)
        rows = positions.view(positions.shape[0], 1, positions.shape[1], 1)
        causal = cols <= rows
        by_window = {w: causal & (cols > rows - w) for w in sliding}
        full = causal if ragged else None
        return [by_window.get(w, full) for w in self._windows]

    def _packed_logits(self, hidden: torch.Tensor, q: list[int], num_logits: list[int]) -> torch.Tensor:
        # hidden: [T, H], the rows' tokens back to back -> [B, max(num_logits), V], as ``_logits``
        n_max, ends = max(num_logits), list(itertools.accumulate(q))
        rows = [[end - n + max(0, min(n - k + c, n - 1)) for c in range(n_max)]
                for end, n, k in zip(ends, q, num_logits)]
        # [B, N] positions, right-padded by repeating the last. The head runs once per position: a batch of
        # one-token rows beside one K=8 row padded to 9 logits each ran it over 72 rows for 16, and a batch-8
        # verify cost 2x a plain step instead of 1.4x.
        positions = sorted({p for row in rows for p in row})
        index = {p: i for i, p in enumerate(positions)}
        logits = self._head(hidden[torch.tensor(positions, device=hidden.device)])  # [P, V]
        return logits[torch.tensor([[index[p] for p in row] for row in rows], device=hidden.device)]  # [B, N, V]

    def _logits(self, hidden: torch.Tensor, q: list[int], num_logits: list[int]) -> torch.Tensor:
        # hidden: [B, Q, H] -> [B, max(num_logits), V] logits at each row's last num_logits positions
        n_max = max(num_logits)
        if min(q) == max(q) and min(num_logits) == n_max <= q[0]:
            picked = hidden[:, q[0] - n_max:]  # every row wants the same tail: a view, no gather
        else:
            pick = torch.tensor(
                [[max(0, min(n - k + c, n - 1)) for c in range(n_max)] for n, k in zip(q, num_logits)],
                device=hidden.device,
            )  # [B, N]: right-padded by repeating the last position
            picked = hidden.gather(1, pick.unsqueeze(-1).expand(-1, -1, hidden.shape[-1]))  # [B, N, H]
        return self._head(picked)

    def _head(self, picked: torch.Tensor) -> torch.Tensor:
        # picked: [B, N, H] final hidden states -> [B, N, V] float32 logits
        if self._fused is not None:  # the same RMSNorm as the module, without its call machinery
            normed = F.rms_norm(picked, (picked.shape[-1],), self._norm.weight, self._norm.variance_epsilon)
        else:
            normed = self._norm(picked)
        logits = self._lm_head(normed)
        if self._logits_scaling != 1.0:
            logits = logits / self._logits_scaling
        return logits.float()

    # ---- calibration -------------------------------------------------------------------------

    def time_step(self, batch_size: int, num_new_tokens: int, context_len: int = 64, repeats: int = 3) -> float:
        """Median seconds of one forward at this batch size, new-token count and context length.

        Uses free slots, fills them with ``context_len`` tokens, and returns them afterwards.
        """
        if batch_size > self.num_free_slots:
            raise RuntimeError(f"time_step needs {batch_size} free slots, {self.num_free_slots} free")
        gen = torch.Generator().manual_seed(0)
        slots = [self.allocate() for _ in range(batch_size)]
        try:
            prompt = torch.randint(0, self.vocab_size, (batch_size, context_len), generator=gen).tolist()
            self.forward(slots, prompt, [1] * batch_size)
            step = torch.randint(0, self.vocab_size, (batch_size, num_new_tokens), generator=gen).tolist()
            times = []
            for _ in range(repeats + 1):  # first run warms caches and allocator
                t0 = time.perf_counter()
                self.forward(slots, step, [num_new_tokens] * batch_size)
                if self.device.type == "cuda":
                    torch.cuda.synchronize()
                times.append(time.perf_counter() - t0)
                for slot in slots:
                    self.truncate(slot, context_len)
            return statistics.median(times[1:])
        finally:
            for slot in slots:
                self.free(slot)
