"""Matmul kernels for the lean layer stack: which kernel runs a projection at which token count.

Decode-time projections multiply a handful of token rows (M = batch x new tokens) by a weight. On
the CPU, torch's default ``F.linear`` (an sgemm with the weight transposed) treats small M as M
separate matrix-vector products, so a 5-token verify paid ~4x a 1-token step in matmul time
(docs/ARCHITECTURE.md (Facts)). Two kernels avoid that:

- ``x @ W^T`` with ``W^T`` stored contiguous [in, out];
- oneDNN with the weight prepacked once (what inductor's CPU freezing does).

Which one wins depends on the host, so it is measured, once per weight shape, when a projection is built
(or adopted from an earlier process on the host: ``adopt_bands``). On an AMD EPYC host the packed kernel
was ~2x faster than ``F.linear`` at M = 4..16 and tied ``x @ W^T`` at M = 3; on an Intel Xeon (AMX) host
with torch 2.13 it lost to ``x @ W^T`` at every M from 1 to 256 (1.1-4x), and made a whole plain engine
8-30% slower (BENCHMARKS.md, "Replica faults"). The packed kernel builds a oneDNN primitive per distinct
M and keeps its memory for good: a replica's RSS stepped up with every new prefill or batch shape. So it
only runs in the band of row counts where it measured faster, capped at ``PACKED_MAX_ROWS``, a bounded
set of shapes.

Both layouts hold the same fp32 values, and either kernel sums in a different order than
``F.linear`` only at the last bit. On CUDA (and for non-fp32 weights) it is ``x @ W^T`` only.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence

import torch

# A probe cycles through copies of its weight that span the model's weights, so each call reads its weight
# from where a forward of that model does: a cache for a model that fits one, memory for one that does not.
# The span is capped past any last-level cache (300 MiB on the Intel Xeon host), and a tiny weight gets at
# most MAX_COLD_COPIES copies.
MAX_PROBE_SET_BYTES = 1 << 30
MAX_COLD_COPIES = 256
PACKED_MAX_ROWS = 64  # bounds the distinct oneDNN primitives (memory kept per row count)
# Row counts timed when a weight shape is first seen. 2 is among them: unprobed, a 2-row product took
# x @ W^T's path, and on the AMD EPYC host a 2-token forward of the served target cost 1.6x a 1-token
# one (11.3 against 6.8 ms) while 3-5 tokens cost ~1.0x; probed, the packed kernel takes it (6.8 ms),
# which is a K=1 verify and a batch-2 plain step.
PROBE_ROWS = (2, 3, 4, 8, 16, 32, 64)
PROBE_REPEATS = 5  # each kernel's best of this many timings, interleaved with the other kernel's
WIN_MARGIN = 0.85  # packed must take <= 85% of x @ W^T's time: a near tie keeps the plain product,
# so two replicas on one host do not pick different kernels from timing noise


def _prepack_supported(weight: torch.Tensor) -> bool:
    return weight.device.type == "cpu" and weight.dtype == torch.float32 and torch.backends.mkldnn.is_available()


def _packed(x: torch.Tensor, packed: torch.Tensor) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")


def winning_band(probe_rows: Sequence[int], plain_us: Sequence[float], packed_us: Sequence[float]) -> range | None:
    """Row counts for the packed kernel: the longest run of probes where it wins by the margin."""
    best: range | None = None
    start = None
    for rows, plain, packed in zip(probe_rows, plain_us, packed_us):
        if packed <= WIN_MARGIN * plain:
            start = rows if start is None else start
            band = range(start, rows + 1)
            best = band if best is None or len(band) > len(best) else best
        else:
            start = None
    return best


def _best_us(fns: Sequence[Callable[[], object]], calls: int, repeats: int = PROBE_REPEATS) -> list[float]:
    """Each kernel's best time per call, their repeats interleaved, so that a moment the host is slower
    (another process, the memory bus) falls on both kernels rather than on one."""
    for fn in fns:
        fn()  # the first call builds the kernel
    best = [float("inf")] * len(fns)
    for _ in range(repeats):
        for i, fn in enumerate(fns):
            t0 = time.perf_counter()
            for _ in range(calls):
                fn()
            best[i] = min(best[i], (time.perf_counter() - t0) / calls * 1e6)
    return best


def _cold_copies(weight_bytes: int, model_bytes: int) -> int:
    """Weights a probe cycles through so that each call reads its weight from where a forward of the
    model reads it. Timed cache-hot, the two kernels compare as compute, not as the weight stream decode
    is: on the served target (AMD EPYC) hot probes kept the packed kernel out of 16 rows for the 576x576
    projection, and a batch-16 step took 35.7 ms against 25.5 ms with it. Timed on a fixed 64 MiB set on
    a host with a 300 MiB cache (Intel Xeon), a 528 MB target's probes ran cache-hot as well and kept the
    packed kernel out of most of its 4-16-row products: a batch-8 plain step took 81.8 ms against 58.6
    probed on the model's span (BENCHMARKS.md, "A target larger than the cache")."""
    span = min(max(model_bytes, weight_bytes), MAX_PROBE_SET_BYTES)
    return max(1, min(MAX_COLD_COPIES, -(-span // weight_bytes)))


# The bands probed (or adopted) in this process, by weight shape, threads and model size. A host's serving
# replicas adopt one set (deployments/calibrate.py keeps it per host): probed again at each start, engines
# on one host chose different bands (a near tie flips with the moment), and ran other kernels than the
# calibration they price with had measured.
_BANDS: dict[str, range | None] = {}


def _band_key(in_features: int, out_features: int, threads: int, model_bytes: int) -> str:
    return f"{in_features}x{out_features}/{threads}t/{model_bytes}B"


def packed_rows(in_features: int, out_features: int, threads: int, model_bytes: int) -> range | None:
    """The row counts where the packed kernel beats ``x @ W^T`` for this shape on this host: adopted
    (``adopt_bands``), or measured once per process (``_probe``)."""
    key = _band_key(in_features, out_features, threads, model_bytes)
    if key not in _BANDS:
        _BANDS[key] = _probe(in_features, out_features, model_bytes)
    return _BANDS[key]


def probed_bands() -> dict[str, list[int] | None]:
    """The bands this process has used, as [first, last] row counts (None: never packed), by shape key."""
    return {key: [band.start, band.stop - 1] if band else None for key, band in _BANDS.items()}


def adopt_bands(bands: Mapping[str, Sequence[int] | None]) -> None:
    """Use these bands (``probed_bands`` of an earlier process on this host) for the shapes not yet used here."""
    for key, band in bands.items():
        _BANDS.setdefault(key, range(band[0], band[1] + 1) if band else None)


def _probe(in_features: int, out_features: int, model_bytes: int) -> range | None:
    """Measured on this host: each call on a weight read from where a forward of a model of
    ``model_bytes`` reads it (``_cold_copies``)."""
    gen = torch.Generator().manual_seed(0)
    copies = _cold_copies(4 * in_features * out_features, model_bytes)
    weights = [torch.randn(out_features, in_features, generator=gen) for _ in range(copies)]
    plain_ws = [w.t().contiguous() for w in weights]
    packed_ws = [torch.ops.mkldnn._reorder_linear_weight(w, None) for w in weights]
    plain_us, packed_us = [], []
    for rows in PROBE_ROWS:
        x = torch.randn(rows, in_features, generator=gen)
        plain, packed = _best_us([lambda x=x: [x @ w for w in plain_ws],
                                  lambda x=x: [_packed(x, w) for w in packed_ws]], calls=max(1, 10 // copies))
        plain_us.append(plain / copies)
        packed_us.append(packed / copies)
    return winning_band(PROBE_ROWS, plain_us, packed_us)


class Projection:
    """y = x @ W^T for a weight W [out, in], with the kernel chosen by the number of token rows."""

    def __init__(self, weight: torch.Tensor, packed_band: range | None | str = "measure",
                 model_bytes: int = 0):  # weight: [out, in]; model_bytes: the weights one forward reads
        self.weight_t = weight.detach().t().contiguous()  # [in, out]
        self.out_features, in_features = weight.shape
        if not _prepack_supported(weight):
            packed_band = None
        elif packed_band == "measure":
            packed_band = packed_rows(in_features, self.out_features, torch.get_num_threads(), model_bytes)
        self.packed_band = packed_band
        # oneDNN's blocked layout: one extra copy of the weight, kept only where it is used.
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), None) if packed_band else None

    @property
    def weight(self) -> torch.Tensor:  # [out, in], a view of the stored [in, out] tensor
        return self.weight_t.t()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:  # [..., in] -> [..., out]
        if self.packed is not None and x.numel() // x.shape[-1] in self.packed_band:
            return _packed(x, self.packed)
        return x @ self.weight_t
