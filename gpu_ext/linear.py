"""Projection matmuls (y = x W^T + b) on CPU: the kernel chosen per call by the number of rows.

Weights stay plain (row-major, contiguous). A decode step multiplies one row (or a few) by each
weight: a matrix-vector product that is bound by reading the weight from memory once, which
torch's `F.linear` (MKL gemv/gemm) does at DRAM speed on the plain layout. Many rows (prefill
chunks, big batches) are bound by compute instead, and there oneDNN's AVX-512 kernels beat MKL's
AVX2 code on AMD CPUs (the CI and dev boxes are AMD EPYC) by ~2.4x ([48 x 256] @ [256 x 2048]:
0.24 ms vs 0.57 ms, 1 thread); oneDNN takes the plain weight and reorders it per call, a pass
over the weight that the compute of `ONEDNN_MIN_ROWS` rows or more hides.

Earlier the weights were packed once into oneDNN's opaque blocked layout for every call: at one
row its kernels read that layout ~25-35% slower than MKL reads the plain one (measured 1 thread,
SmolLM2-135M shapes: [1 x 576] @ [576 x 3072] 0.94 ms packed vs 0.76 ms plain, [576 x 1536]
0.49 vs 0.32 ms), and a tied lm_head needed a packed copy of the embedding. TIDAL_PACK_WEIGHTS=1
brings packing back (prefill-heavy loads). The oneDNN path is probed per dtype (result checked
against F.linear) and skipped where it fails. CUDA weights are never touched here.

Up to `cpu_matvec.MAX_ROWS` rows of fp32 (a decode step) go to gpu_ext's own C++ loops
(cpu_matvec.py: one weight row after another, a single sequential stream, over the torch thread
count by gpu_ext/cpu_pool.py; on the dev box, 1 thread, the earlier 4-row version took ~25% less
time than MKL's gemv and this one ~18% less again) where the CPU kernel library is built;
`small_ops` hands them to the model for the fused forms (norm + projection, projection +
residual, SiLU-gate + projection). TIDAL_CPU_MATVEC=0 keeps F.linear.
"""
from __future__ import annotations

import os
from typing import Any

import torch
import torch.nn.functional as F

from gpu_ext.cpu_matvec import MAX_ROWS

# Rows from which oneDNN (reordering the weight per call) beats MKL on the plain weight.
ONEDNN_MIN_ROWS = 16

_SUPPORTED: dict[torch.dtype, bool] = {}
_SMALL: list[Any] = []  # [the ops or None] once resolved


def small_ops(device: torch.device | str, dtype: torch.dtype) -> Any | None:
    """gpu_ext's C++ few-row projections (cpu_matvec.py) for fp32 CPU, or None (not built, off, other dtype)."""
    if torch.device(device).type != "cpu" or dtype != torch.float32:
        return None
    if not _SMALL:
        from gpu_ext import cpu_attention

        ops = cpu_attention.cpu_ops() if os.environ.get("TIDAL_CPU_MATVEC", "1") != "0" else None
        _SMALL.append(ops if ops is not None and hasattr(ops, "small_linear") else None)
    return _SMALL[0]


def huge_pages(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """fp32 CPU weights copied into one 2 MiB-aligned block backed by transparent huge pages
    (cpu_matvec.py `to_hugepages`: ~19% less time for the decode projections on the dev box);
    the tensors themselves where that does not apply (other device or dtype, no kernel library,
    TIDAL_HUGEPAGES=0)."""
    if not tensors or any(t.device.type != "cpu" or t.dtype != torch.float32 or t.is_mkldnn for t in tensors):
        return tensors
    ops = small_ops("cpu", torch.float32)
    if ops is None or os.environ.get("TIDAL_HUGEPAGES", "1") == "0":
        return tensors
    return list(ops.to_hugepages(tensors))


def _small_fits(x: torch.Tensor, w: torch.Tensor) -> bool:
    return (x.dim() == 2 and x.shape[0] <= MAX_ROWS and x.dtype == torch.float32 and w.dtype == torch.float32
            and x.device.type == "cpu" and x.is_contiguous() and w.is_contiguous() and not x.requires_grad)


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
            tol = 1e-4 if dtype == torch.float32 else 5e-2
            want = F.linear(x, w, b).float()
            packed = _onednn_linear(x, torch.ops.mkldnn._reorder_linear_weight(w), b).float()
            plain = _onednn_linear(x, w, b).float()
            ok = torch.allclose(packed, want, atol=tol, rtol=tol) and torch.allclose(plain, want, atol=tol, rtol=tol)
        except (RuntimeError, AttributeError, NotImplementedError):
            ok = False
        _SUPPORTED[dtype] = ok
    return _SUPPORTED[dtype]


def onednn_usable(device: torch.device | str, dtype: torch.dtype) -> bool:
    return torch.device(device).type == "cpu" and torch.backends.mkldnn.is_available() and _probe(dtype)


def packing_enabled(device: torch.device | str, dtype: torch.dtype) -> bool:
    return os.environ.get("TIDAL_PACK_WEIGHTS", "0") == "1" and onednn_usable(device, dtype)


def pack_weight(w: torch.Tensor) -> torch.Tensor:
    """The weight as `linear` takes it: itself (contiguous), or packed for oneDNN with TIDAL_PACK_WEIGHTS=1."""
    if w.dim() != 2:
        return w
    if not packing_enabled(w.device, w.dtype):
        return w if w.is_contiguous() else w.contiguous()
    return torch.ops.mkldnn._reorder_linear_weight(w.contiguous())


def linear(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    if w.is_mkldnn:
        return _onednn_linear(x, w, bias)
    if x.dim() == 2 and x.shape[0] <= MAX_ROWS and small_ops(x.device, x.dtype) is not None and _small_fits(x, w):
        return _SMALL[0].small_linear(x, w, bias, None)
    if x.dim() == 2 and x.shape[0] >= ONEDNN_MIN_ROWS and onednn_usable(x.device, x.dtype):
        return _onednn_linear(x, w, bias)
    return F.linear(x, w, bias)


def weight_nbytes(w: torch.Tensor) -> int:
    """Bytes of a weight, packed or not (packed tensors have no storage to ask)."""
    return w.numel() * w.element_size()
