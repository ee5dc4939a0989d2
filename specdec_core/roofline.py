"""Roofline: step times for hardware we do not have, from model shapes and datasheet rates.

Vocabulary (one forward of one model, per GPU of a tensor-parallel group of `tp`):
- tokens: new tokens in the forward (rows x tokens per row: 1 for a plain step or a draft pass,
  K+1 for a verify, the prompt for a prefill); rows: sequences in the batch.
- context: cached tokens per row that attention reads.
- forward time = per-layer launch cost x layers                      (fixed, grows with depth)
               + (streamed weights + KV of every row at the context) / bandwidth
               + tokens x FLOPs per token / FLOP rate                 (additive, not max())
               + 2 all-reduces per layer when tp > 1 (latency + activations over the link).
  Additive, as a fitted vLLM step is (SpecDecode-Bench simulator, `predictor.py`: a fixed part
  plus ~21 us per batched token for Llama-3.1-8B on an H100): pricing a forward as
  max(memory, compute) makes a verify's K extra tokens free until batch x (K+1) nears the ridge
  point (~300 tokens on an H100), and speculation then never loses at the batches where it does.
- A speculative step is K draft passes (each one forward of the draft plus the proposer's own
  per-pass work), one verify of K+1 tokens per row, and the engine's per-step work (scheduler,
  sampler, output processing), which a plain step pays too.

The rates are nominal datasheet numbers derated by the same fractions for every device; the
engine costs and the compute fraction are fitted to SpecDecode-Bench's published vLLM
measurements (Liu et al., arXiv 2601.11580; the points are in specdec_bench/reference/, the comparison
in BENCHMARKS.md). `roofline_costs` turns all this into the `StepCosts` that `CostModel` answers
from, exactly as a calibration on the hardware would. Pure: no I/O, no torch.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from specdec_core.step_costs import DEFAULT_BATCHES, DEFAULT_HOP_OVERHEAD_S, DEFAULT_QS, StepCosts

# Bytes per weight by serving dtype. The KV cache and the all-reduced activations stay 16-bit
# (vLLM's default kv_cache_dtype "auto" follows the activations, not fp8 weights).
DTYPE_BYTES: Mapping[str, int] = {"bf16": 2, "fp16": 2, "fp8": 1}
ACTIVATION_BYTES = 2

# Achieved fractions of the nominal rates, the same for every device ("derated consistently").
# Memory: SpecDecode-Bench's fitted vLLM step reads the KV cache at 39.3 ns per cached token of
# Llama-3.1-8B (131 kB), 3.34 TB/s on an H100 (simulator `predictor.py`, `target_c_kv`): the
# nominal rate. What whole forwards lose beyond it is in the per-layer cost below.
MEMORY_EFFICIENCY = 1.0
# Compute: FLOPs per token (2 per streamed weight plus attention) over everything a decode-sized
# token costs in vLLM (GEMMs at <= 512 tokens, attention, norms, logits), fitted to the draft-model
# speedups and time shares of SpecDecode-Bench figures 1 and 4 (H100, vLLM V1). The same paper's
# simulator fit for Llama-3.1-8B with EAGLE at batch <= 64 (21 us per token) is 0.77: see
# BENCHMARKS.md for what the gap does to that workload.
COMPUTE_EFFICIENCY = 0.40


@dataclass(frozen=True)
class DeviceSpec:
    """Nominal datasheet rates of one GPU; forward times derate them by the module's efficiencies.

    flops: dense tensor-core FLOP/s by dtype (a dtype without tensor cores, e.g. fp8 on an A100,
    computes at the bf16 rate: weight-only fp8). link_Bps: NVLink bandwidth, one direction.
    """

    name: str
    mem_bandwidth_Bps: float
    flops: Mapping[str, float]
    link_Bps: float

    def flop_rate(self, dtype: str) -> float:
        return self.flops.get(dtype, self.flops["bf16"])


# NVIDIA H100 SXM5 datasheet: 3.35 TB/s HBM3; 989 TFLOP/s bf16/fp16 and 1979 fp8, dense;
# NVLink 4 900 GB/s (450 each way).
H100 = DeviceSpec("H100", 3.35e12, {"bf16": 989e12, "fp16": 989e12, "fp8": 1979e12}, 450e9)
# NVIDIA H200 SXM datasheet: 4.8 TB/s HBM3e, same GH100 tensor cores and NVLink as the H100.
H200 = DeviceSpec("H200", 4.8e12, {"bf16": 989e12, "fp16": 989e12, "fp8": 1979e12}, 450e9)
# NVIDIA A100 SXM4 80GB datasheet: 2.039 TB/s HBM2e; 312 TFLOP/s bf16/fp16 dense, no fp8 tensor
# cores; NVLink 3 600 GB/s (300 each way).
A100 = DeviceSpec("A100", 2.039e12, {"bf16": 312e12, "fp16": 312e12}, 300e9)
DEVICES: Mapping[str, DeviceSpec] = {"a100": A100, "h100": H100, "h200": H200}


@dataclass(frozen=True)
class EngineCosts:
    """What the serving engine adds to the GPU work, in seconds. Defaults: vLLM V1 (0.10-0.11)
    with CUDA graphs on an H100, fitted to SpecDecode-Bench figures 1 and 4 unless said otherwise."""

    per_layer_s: float = 18e-6  # launch and piecewise-graph cost per layer per forward (fitted)
    all_reduce_s: float = 27e-6  # latency of one tensor-parallel all-reduce (fitted, 4 x H100)
    draft_pass_s: float = 0.7e-3  # the draft-model proposer's own work per pass: inputs, sampling (fitted)
    # Per step: 1.2 ms from the SpecDecode-Bench simulator (`overhead_constant_per_step`, vLLM on
    # an H100); per row per step (output processing in-process, as the benchmark ran it): fitted.
    step_s: float = 1.2e-3
    step_per_row_s: float = 45e-6

    def step_overhead(self, rows: float) -> float:
        return self.step_s + rows * self.step_per_row_s


VLLM = EngineCosts()


@dataclass(frozen=True)
class ModelShape:
    """A decoder-only transformer's sizes. num_params counts every weight matrix once (norms
    aside); a forward streams all of them but the embedding table, which it only indexes (a tied
    table is streamed as the LM head)."""

    num_params: float
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    tied_embeddings: bool = False
    dtype: str = "bf16"

    @classmethod
    def from_hf_config(cls, config: Any) -> ModelShape:
        """From a HF Llama/Qwen-style config (object or dict); parameters counted from shapes."""
        get = config.get if isinstance(config, Mapping) else lambda k, d=None: getattr(config, k, d)
        hidden, layers, vocab = get("hidden_size"), get("num_hidden_layers"), get("vocab_size")
        heads = get("num_attention_heads")
        kv_heads = get("num_key_value_heads") or heads
        head_dim = get("head_dim") or hidden // heads
        tied = bool(get("tie_word_embeddings", False))
        attn = hidden * heads * head_dim * 2 + hidden * kv_heads * head_dim * 2  # q, o; k, v
        mlp = 3 * hidden * get("intermediate_size")  # gate, up, down
        embed = vocab * hidden * (1 if tied else 2)
        return cls(
            num_params=float(layers * (attn + mlp) + embed),
            num_layers=layers,
            hidden_size=hidden,
            num_heads=heads,
            num_kv_heads=kv_heads,
            head_dim=head_dim,
            vocab_size=vocab,
            tied_embeddings=tied,
            dtype=_serving_dtype(get),
        )

    @property
    def streamed_params(self) -> float:
        return self.num_params - (0 if self.tied_embeddings else self.vocab_size * self.hidden_size)

    @property
    def kv_bytes_per_token(self) -> int:
        return self.num_layers * 2 * self.num_kv_heads * self.head_dim * ACTIVATION_BYTES

    def attention_flops(self, context_len: float) -> float:
        """QK^T and AV of one new token over `context_len` cached tokens (16-bit, whatever the weights)."""
        return 4 * context_len * self.num_layers * self.num_heads * self.head_dim


def _serving_dtype(get: Any) -> str:
    """fp8 for an fp8-quantized checkpoint, fp16 for a float16 one, else bf16 (vLLM serves float32
    checkpoints in 16 bits)."""
    if (get("quantization_config") or {}).get("quant_method") == "fp8":
        return "fp8"
    dtype = str(get("torch_dtype") or get("dtype") or "bfloat16")
    return "fp16" if "float16" in dtype and "bfloat16" not in dtype else "bf16"


def forward_time(model: ModelShape, device: DeviceSpec, tokens: float, rows: float, context_len: float,
                 tp: int = 1, dtype: str | None = None, engine: EngineCosts = VLLM) -> float:
    """Seconds for one forward of `tokens` new tokens over `rows` rows with `context_len` cached
    tokens each, the model split `tp` ways (see the module docstring)."""
    dtype = dtype or model.dtype
    moved = model.streamed_params * DTYPE_BYTES[dtype] + rows * context_len * model.kv_bytes_per_token
    memory = moved / tp / (MEMORY_EFFICIENCY * device.mem_bandwidth_Bps)
    per_token = 2 * model.streamed_params / device.flop_rate(dtype) + model.attention_flops(
        context_len) / device.flop_rate("bf16")
    compute = tokens * per_token / tp / COMPUTE_EFFICIENCY
    return model.num_layers * engine.per_layer_s + memory + compute + _all_reduce_time(
        model, device, tokens, tp, engine)


def _all_reduce_time(model: ModelShape, device: DeviceSpec, tokens: float, tp: int, engine: EngineCosts) -> float:
    """Two per layer (after attention and after the MLP); a ring moves 2 (tp-1)/tp of the activations."""
    if tp == 1:
        return 0.0
    moved = tokens * model.hidden_size * ACTIVATION_BYTES * 2 * (tp - 1) / tp
    return 2 * model.num_layers * (engine.all_reduce_s + moved / device.link_Bps)


def prefill_time(model: ModelShape, device: DeviceSpec, rows: int, prompt_len: int, tp: int = 1,
                 dtype: str | None = None, engine: EngineCosts = VLLM) -> float:
    """One forward over every row's prompt; each prompt token attends to half the prompt on average."""
    return forward_time(model, device, rows * prompt_len, rows, prompt_len / 2, tp, dtype, engine)


def roofline_costs(
    target: ModelShape,
    draft: ModelShape | None,
    device: DeviceSpec,
    batches: Sequence[int] = DEFAULT_BATCHES,
    qs: Sequence[int] = DEFAULT_QS,
    context_len: int = 1024,
    hop_overhead_s: Mapping[str, float] = DEFAULT_HOP_OVERHEAD_S,
    tp: int = 1,
    dtype: str | None = None,
    engine: EngineCosts = VLLM,
    draft_window: int | None = None,
) -> StepCosts:
    """A StepCosts predicted for `device`, so CostModel answers for it.

    target_s: the target forward plus the engine's per-step work (every step, plain or
    speculative, has exactly one); draft_s: one draft pass, the proposer's per-pass work included.
    The context slopes carry the KV reads and attention FLOPs, so `at_context` reprices the grid.
    The draft runs with the target's tensor parallelism (vLLM requires it of draft models).
    ``draft_window``: the draft's cache bounded to that many positions (``KVWindow``): it reads at
    most that context, and gains nothing from a longer one."""
    draft_context = min(context_len, draft_window) if draft_window else context_len

    def target_s(b: int, q: int) -> float:
        return forward_time(target, device, b * q, b, context_len, tp, dtype, engine) + engine.step_overhead(b)

    def draft_s(b: int) -> float:
        if draft is None:
            return 0.0
        return forward_time(draft, device, b, b, draft_context, tp, dtype, engine) + engine.draft_pass_s

    return StepCosts(
        batches=tuple(batches),
        qs=tuple(qs),
        target_s=tuple(tuple(target_s(b, q) for q in qs) for b in batches),
        draft_s=tuple(draft_s(b) for b in batches),
        hop_overhead_s=dict(hop_overhead_s),
        source=f"roofline:{device.name}" + (f" tp={tp}" if tp > 1 else ""),
        context_len=context_len,
        context_slope_s=tuple(_context_slope(target, device, q, tp) for q in qs),
        draft_context_slope_s=_context_slope(draft, device, 1, tp) if draft and not draft_window else 0.0,
    )


def _context_slope(model: ModelShape, device: DeviceSpec, q: int, tp: int) -> float:
    """Seconds per extra cached token of one row: its KV read plus q tokens' attention FLOPs."""
    kv = model.kv_bytes_per_token / (MEMORY_EFFICIENCY * device.mem_bandwidth_Bps)
    attention = q * model.attention_flops(1) / (COMPUTE_EFFICIENCY * device.flop_rate("bf16"))
    return (kv + attention) / tp
