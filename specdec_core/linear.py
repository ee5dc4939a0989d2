"""Matmul kernels for the lean layer stack: which kernel runs a projection at which token count.

Decode-time projections multiply a handful of token rows (M = batch x new tokens) by a weight. On
the CPU, torch's default ``F.linear`` (an sgemm with the weight transposed) treats small M as M
separate matrix-vector products, so a 5-token verify paid ~4x a 1-token step in matmul time
(measured on these machines, docs/ARCHITECTURE.md (Facts)), which inflates the verify/plain cost ratio that
decides whether speculation pays. Measured per layer stack of the shipped target (1 thread):

- M <= 2: ``x @ W^T`` with ``W^T`` stored contiguous [in, out] is ~2-3x faster than ``F.linear``;
- M >= 3: oneDNN with the weight prepacked once (what inductor's CPU freezing does) is ~2x faster
  than ``F.linear`` at M = 4..16 and ~1.4x at M = 64 (at M = 2 it loses to the plain product,
  at M = 3 they tie).

Both layouts hold the same fp32 values, and either kernel sums in a different order than
``F.linear`` only at the last bit. On CUDA (and for non-fp32 weights) it is ``x @ W^T`` only.
"""

from __future__ import annotations

import torch

PREPACKED_MIN_ROWS = 3  # token rows from which the prepacked kernel wins (measured, see above)


def _prepack_supported(weight: torch.Tensor) -> bool:
    return weight.device.type == "cpu" and weight.dtype == torch.float32 and torch.backends.mkldnn.is_available()


class Projection:
    """y = x @ W^T for a weight W [out, in], with the kernel chosen by the number of token rows."""

    def __init__(self, weight: torch.Tensor):  # [out, in]
        self.weight_t = weight.detach().t().contiguous()  # [in, out]
        self.out_features = weight.shape[0]
        # The prepacked copy is oneDNN's blocked layout: one extra copy of the weight on CPU only.
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), None) if _prepack_supported(weight) else None

    @property
    def weight(self) -> torch.Tensor:  # [out, in], a view of the stored [in, out] tensor
        return self.weight_t.t()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:  # [..., in] -> [..., out]
        if self.packed is not None and x.numel() >= PREPACKED_MIN_ROWS * x.shape[-1]:
            return torch.ops.mkldnn._linear_pointwise(x, self.packed, None, "none", [], "")
        return x @ self.weight_t
