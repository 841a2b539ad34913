"""CPU paged decode attention: a small C++ kernel that reads K/V straight from the blocks.

The torch path gathers each sequence's blocks into a padded [B, S, ...] copy and runs
SDPA over it: three passes over the KV (read, write, read) plus padding. This kernel
walks each sequence's block table and reads every K and V row once (measured ~2x less
time for the engine's decode shapes, 1 thread). Same math: scaled dot product, softmax
in fp32 with the max subtracted, weighted sum of V; GQA by indexing the kv head.

Built on first use with torch's C++ extension JIT (~10-30 s once per machine, cached
under TORCH_EXTENSIONS_DIR, default ~/.cache/torch_extensions), parallel over sequences
with torch's own thread pool. Anything that goes wrong (no compiler, a build error, a
non-fp32 dtype) leaves the caller on the torch path. TIDAL_CPU_KERNELS=0 turns it off.
"""
from __future__ import annotations

import hashlib
import logging
import os
import platform
import tempfile
from collections.abc import Callable
from pathlib import Path

import torch

log = logging.getLogger(__name__)

_SOURCE = r"""
#include <ATen/core/Tensor.h>
#include <ATen/Parallel.h>
#include <ATen/ops/empty_like.h>
#include <torch/library.h>
#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

// q [B, H, D] fp32; k/v cache [num_blocks, BS, KVH, D]; tables [B, NB] int64;
// ctx [B] int64: the sequence attends keys [max(0, ctx - window), ctx) (window 0: all).
at::Tensor paged_decode(const at::Tensor& q, const at::Tensor& kc, const at::Tensor& vc,
                        const at::Tensor& tables, const at::Tensor& ctx, double scale, int64_t window) {
  TORCH_CHECK(q.is_contiguous() && kc.is_contiguous() && vc.is_contiguous() && tables.is_contiguous());
  const int64_t B = q.size(0), H = q.size(1), D = q.size(2);
  const int64_t BS = kc.size(1), KVH = kc.size(2), G = H / KVH, NB = tables.size(1);
  auto out = at::empty_like(q);
  const float* __restrict qp = q.data_ptr<float>();
  const float* __restrict kp = kc.data_ptr<float>();
  const float* __restrict vp = vc.data_ptr<float>();
  const int64_t* tp = tables.data_ptr<int64_t>();
  const int64_t* cp = ctx.data_ptr<int64_t>();
  float* op = out.data_ptr<float>();
  const float sc = static_cast<float>(scale);
  const int64_t row = KVH * D;  // one token's K (or V) inside a block
  at::parallel_for(0, B, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores;
    std::vector<float> acc(H * D);
    for (int64_t b = begin; b < end; ++b) {
      const int64_t n = cp[b];
      const int64_t first = (window > 0 && n > window) ? n - window : 0;
      const int64_t len = n - first;
      scores.resize(H * len);
      const float* qb = qp + b * H * D;
      for (int64_t t = first; t < n; ++t) {
        const float* kt = kp + (tp[b * NB + t / BS] * BS + t % BS) * row;
        for (int64_t h = 0; h < H; ++h) {
          const float* kh = kt + (h / G) * D;
          const float* qh = qb + h * D;
          float s = 0.f;
#pragma omp simd reduction(+:s)
          for (int64_t i = 0; i < D; ++i) s += qh[i] * kh[i];
          scores[h * len + (t - first)] = s * sc;
        }
      }
      for (int64_t h = 0; h < H; ++h) {
        float* s = scores.data() + h * len;
        float m = -std::numeric_limits<float>::infinity();
        for (int64_t t = 0; t < len; ++t) m = std::max(m, s[t]);
        float sum = 0.f;
#pragma omp simd reduction(+:sum)
        for (int64_t t = 0; t < len; ++t) { s[t] = expf(s[t] - m); sum += s[t]; }
        const float inv = 1.f / sum;
#pragma omp simd
        for (int64_t t = 0; t < len; ++t) s[t] *= inv;
      }
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t t = first; t < n; ++t) {
        const float* vt = vp + (tp[b * NB + t / BS] * BS + t % BS) * row;
        for (int64_t h = 0; h < H; ++h) {
          const float p = scores[h * len + (t - first)];
          const float* vh = vt + (h / G) * D;
          float* a = acc.data() + h * D;
#pragma omp simd
          for (int64_t i = 0; i < D; ++i) a[i] += p * vh[i];
        }
      }
      std::copy(acc.begin(), acc.end(), op + b * H * D);
    }
  });
  return out;
}

TORCH_LIBRARY(NAMESPACE, m) { m.def("paged_decode", &paged_decode); }
"""
_FLAGS = ["-O3", "-march=native", "-ffast-math", "-fopenmp-simd"]
_kernel: Callable[..., torch.Tensor] | None = None
_tried = False


def _namespace() -> str:
    # -march=native code must not be reused on another CPU: key the build by the CPU too.
    cpu = platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu += next((line for line in f if line.startswith("flags")), "")
    except OSError:
        pass
    digest = hashlib.sha256((_SOURCE + " ".join(_FLAGS) + cpu + torch.__version__).encode()).hexdigest()[:12]
    return f"tidal_cpu_attn_{digest}"


def paged_decode_kernel() -> Callable[..., torch.Tensor] | None:
    """The compiled kernel, built once per process (None: use the torch path)."""
    global _kernel, _tried
    if _tried:
        return _kernel
    _tried = True
    if os.environ.get("TIDAL_CPU_KERNELS", "1") == "0":
        return None
    name = _namespace()
    try:
        from torch.utils.cpp_extension import load

        # A source file, not load_inline: that would prepend <torch/extension.h> (2x the build time).
        src = Path(tempfile.gettempdir()) / "tidal_cpu_kernels" / f"{name}.cpp"
        src.parent.mkdir(parents=True, exist_ok=True)
        text = _SOURCE.replace("NAMESPACE", name)
        if not src.is_file() or src.read_text() != text:
            tmp = src.with_suffix(f".{os.getpid()}.tmp")
            tmp.write_text(text)
            tmp.replace(src)
        load(name, [str(src)], extra_cflags=_FLAGS, extra_ldflags=["-lmvec"], is_python_module=False, verbose=False)
        _kernel = getattr(torch.ops, name).paged_decode
    except Exception as exc:  # no compiler, headers or libmvec: the torch path still works
        log.warning("CPU paged attention kernel unavailable, using torch: %s", exc)
        _kernel = None
    return _kernel


def supported(q: torch.Tensor) -> bool:
    return q.device.type == "cpu" and q.dtype == torch.float32 and paged_decode_kernel() is not None
