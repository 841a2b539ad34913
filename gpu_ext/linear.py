"""Projection matmuls (y = x W^T + b) with weights packed for the device's fastest kernel.

On CPU, torch's fp32 `F.linear` goes to MKL, which on AMD CPUs (the CI and dev boxes are
AMD EPYC) runs AVX2 code; oneDNN runs AVX-512 there and is ~2.4x faster on the engine's
shapes (measured: [48 x 256] @ [256 x 2048]: 0.24 ms vs 0.57 ms, 1 thread). oneDNN wants
its weights reordered once into an opaque blocked layout: `pack_weight` does that, and
`linear` dispatches on the weight. Packing is probed per dtype (result checked against
F.linear) and skipped where it fails, so other platforms get plain F.linear. A packed
weight is a CPU-only opaque tensor: no storage access, no views (keep the plain tensor
where one is needed, e.g. the embedding).

Set TIDAL_PACK_WEIGHTS=0 to disable packing. CUDA weights are never packed here.
"""
from __future__ import annotations

import os

import torch
import torch.nn.functional as F

_SUPPORTED: dict[torch.dtype, bool] = {}


def _onednn_linear(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, w, bias, "none", [], "")


def _probe(dtype: torch.dtype) -> bool:
    if dtype not in _SUPPORTED:
        ok = False
        try:
            gen = torch.Generator().manual_seed(0)
            w = torch.randn(24, 40, generator=gen).to(dtype)
            x = torch.randn(5, 40, generator=gen).to(dtype)
            b = torch.randn(24, generator=gen).to(dtype)
            got = _onednn_linear(x, torch.ops.mkldnn._reorder_linear_weight(w), b).float()
            tol = 1e-4 if dtype == torch.float32 else 5e-2
            ok = torch.allclose(got, F.linear(x, w, b).float(), atol=tol, rtol=tol)
        except (RuntimeError, AttributeError, NotImplementedError):
            ok = False
        _SUPPORTED[dtype] = ok
    return _SUPPORTED[dtype]


def packing_enabled(device: torch.device | str, dtype: torch.dtype) -> bool:
    if os.environ.get("TIDAL_PACK_WEIGHTS", "1") == "0" or torch.device(device).type != "cpu":
        return False
    return torch.backends.mkldnn.is_available() and _probe(dtype)


def pack_weight(w: torch.Tensor) -> torch.Tensor:
    """The weight in the layout `linear` runs fastest with (itself where nothing is faster)."""
    if w.dim() != 2 or not packing_enabled(w.device, w.dtype):
        return w
    return torch.ops.mkldnn._reorder_linear_weight(w.contiguous())


def linear(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    if w.is_mkldnn:
        return _onednn_linear(x, w, bias)
    return F.linear(x, w, bias)


def weight_nbytes(w: torch.Tensor) -> int:
    """Bytes of a weight, packed or not (packed tensors have no storage to ask)."""
    return w.numel() * w.element_size()
