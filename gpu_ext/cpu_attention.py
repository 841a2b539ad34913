"""CPU paged decode attention: a small C++ kernel that reads K/V straight from the blocks.

The torch path gathers each sequence's blocks into a padded [B, S, ...] copy and runs
SDPA over it: three passes over the KV (read, write, read) plus padding. This kernel
walks each sequence's block table and reads every K and V row once (measured ~2x less
time for the engine's decode shapes, 1 thread). Same math: scaled dot product, softmax
in fp32 with the max subtracted, weighted sum of V; GQA by indexing the kv head.

Runs of consecutive block ids are read as one stretch (the block manager hands out
contiguous per-layer chains, so a sequence's K for a layer is usually one segment), with
software prefetch ahead of the loads. With AVX2+FMA and head_dim 8/16/32/64/128, each K
row of a kv head is read once for all query heads of its GQA group in tiles of 8 tokens
whose dot products are reduced together, and V is accumulated in registers over tiles of
64 tokens. Measured 1 thread, 128 sequences of 200-2048 tokens, 8/2 heads, head_dim 32:
6.8 -> 4.0 ms per call for contiguous chains (9-11 -> 18-19 GB/s of K+V). Other head
dims or CPUs take the portable loops. The build uses -march=native and is keyed by the
CPU's flags, so a cached build never runs on a CPU it was not compiled for.

Built ahead of time into the venv with torch's C++ extension JIT (`make install` and
`tidal up` run `python -m gpu_ext.cpu_attention --build`; where and why: gpu_ext/cpu_kernel_build.py),
parallel over sequences on gpu_ext/cpu_pool.py's threads (as many as `torch.get_num_threads()`). Anything that goes wrong (no compiler, a
build error, a non-fp32 dtype) leaves the caller on the torch path. TIDAL_CPU_KERNELS=0 turns it off.
"""
from __future__ import annotations

import logging
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING

from gpu_ext import cpu_decode, cpu_kernel_build, cpu_matvec, cpu_pool

if TYPE_CHECKING:  # torch is imported when the kernel is used: `tidal up` asks `pending()` without it
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
#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define TIDAL_AVX2 1
#endif
""" + cpu_pool.SOURCE + r"""
// One stretch of a sequence's keys that lies in consecutive blocks: `count` tokens whose
// K (V) rows start at k (v), the first being token `t0` of the attended range.
struct Seg { int64_t t0, count; const float* k; const float* v; };

// Runs of consecutive block ids become one segment (a contiguous chain: one segment).
static void segments(const int64_t* table, int64_t first, int64_t n, int64_t BS, int64_t row,
                     const float* kp, const float* vp, std::vector<Seg>& out) {
  out.clear();
  int64_t t = first;
  while (t < n) {
    int64_t j = t / BS;
    const int64_t start = (table[j] * BS + t % BS) * row;
    int64_t end = (j + 1) * BS;
    while (end < n && table[j + 1] == table[j] + 1) { ++j; end += BS; }
    end = std::min(end, n);
    out.push_back({t - first, end - t, kp + start, vp + start});
    t = end;
  }
}

#ifdef TIDAL_AVX2
static inline float hsum(__m256 x) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

// The memory loop runs at DRAM latency unless the next rows are requested while these are
// computed on (software prefetch: measured ~1.5x on a sequence's K, more when blocks jump).
constexpr int64_t PF_TOKENS = 32;
static inline void prefetch_rows(const float* p, int64_t floats) {
  for (int64_t i = 0; i < floats; i += 16) _mm_prefetch(reinterpret_cast<const char*>(p + i), _MM_HINT_T0);
}

// The 8 horizontal sums of a[0..7], in order, as one vector.
static inline __m256 hsum8(const __m256* a) {
  const __m256 u0 = _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[3]));
  const __m256 u1 = _mm256_hadd_ps(_mm256_hadd_ps(a[4], a[5]), _mm256_hadd_ps(a[6], a[7]));
  return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}

// scores[h * len + t] = sc * q[h] . K[t][h / G] over one segment. Tiles of 8 tokens stay in
// L1 while every query head of each kv head reads them (each K row comes from memory once);
// the 8 dot products of a tile are reduced together instead of one by one.
template <int DC>
static void seg_scores(const float* q, const Seg& s, int64_t g0, int64_t g1, int64_t G, int64_t row, float sc,
                       float* scores, int64_t len) {
  constexpr int64_t D = DC * 8;
  const __m256 scv = _mm256_set1_ps(sc);
  int64_t j = 0;
  for (; j + 8 <= s.count; j += 8) {
    const float* kt = s.k + j * row;
    prefetch_rows(kt + PF_TOKENS * row, 8 * row);
    for (int64_t g = g0; g < g1; ++g) {
      for (int64_t h = g * G; h < (g + 1) * G; ++h) {
        __m256 qv[DC];
        for (int c = 0; c < DC; ++c) qv[c] = _mm256_loadu_ps(q + h * D + 8 * c);
        __m256 a[8];
        for (int u = 0; u < 8; ++u) {
          const float* kr = kt + u * row + g * D;
          __m256 acc = _mm256_mul_ps(qv[0], _mm256_loadu_ps(kr));
          for (int c = 1; c < DC; ++c) acc = _mm256_fmadd_ps(qv[c], _mm256_loadu_ps(kr + 8 * c), acc);
          a[u] = acc;
        }
        _mm256_storeu_ps(scores + h * len + s.t0 + j, _mm256_mul_ps(hsum8(a), scv));
      }
    }
  }
  for (; j < s.count; ++j) {
    const float* kt = s.k + j * row;
    for (int64_t h = g0 * G; h < g1 * G; ++h) {
      const float* kr = kt + (h / G) * D;
      __m256 acc = _mm256_mul_ps(_mm256_loadu_ps(q + h * D), _mm256_loadu_ps(kr));
      for (int c = 1; c < DC; ++c) acc = _mm256_fmadd_ps(_mm256_loadu_ps(q + h * D + 8 * c), _mm256_loadu_ps(kr + 8 * c), acc);
      scores[h * len + s.t0 + j] = hsum(acc) * sc;
    }
  }
}

// acc[h] += sum_t p[h][t] * V[t][h / G] over one segment, in tiles of 64 tokens (L1-resident
// while the G query heads of a kv head read them). Consecutive tokens go to NA independent
// sets of accumulators: one set would wait on the FMA latency every token.
template <int DC>
static void seg_values(const float* scores, const Seg& s, int64_t g0, int64_t g1, int64_t G, int64_t row,
                       float* acc, int64_t len) {
  constexpr int64_t D = DC * 8, TILE = 64;
  constexpr int NA = DC >= 8 ? 1 : 8 / DC;
  for (int64_t t0 = 0; t0 < s.count; t0 += TILE) {
    const int64_t t1 = std::min(s.count, t0 + TILE);
    prefetch_rows(s.v + (t0 + TILE) * row, TILE * row);
    for (int64_t g = g0; g < g1; ++g) {
      for (int64_t h = g * G; h < (g + 1) * G; ++h) {
        __m256 a[NA][DC];
        for (int c = 0; c < DC; ++c) a[0][c] = _mm256_loadu_ps(acc + h * D + 8 * c);
        for (int u = 1; u < NA; ++u)
          for (int c = 0; c < DC; ++c) a[u][c] = _mm256_setzero_ps();
        const float* p = scores + h * len + s.t0;
        const float* vr = s.v + t0 * row + g * D;
        int64_t t = t0;
        for (; t + NA <= t1; t += NA, vr += NA * row) {
          for (int u = 0; u < NA; ++u) {
            const __m256 pb = _mm256_set1_ps(p[t + u]);
            for (int c = 0; c < DC; ++c) a[u][c] = _mm256_fmadd_ps(pb, _mm256_loadu_ps(vr + u * row + 8 * c), a[u][c]);
          }
        }
        for (; t < t1; ++t, vr += row) {
          const __m256 pb = _mm256_set1_ps(p[t]);
          for (int c = 0; c < DC; ++c) a[0][c] = _mm256_fmadd_ps(pb, _mm256_loadu_ps(vr + 8 * c), a[0][c]);
        }
        for (int u = 1; u < NA; ++u)
          for (int c = 0; c < DC; ++c) a[0][c] = _mm256_add_ps(a[0][c], a[u][c]);
        for (int c = 0; c < DC; ++c) _mm256_storeu_ps(acc + h * D + 8 * c, a[0][c]);
      }
    }
  }
}
#endif

// Portable fallback (no AVX2/FMA, or a head_dim the vector path has no instance for).
static void seg_scores_any(const float* q, const Seg& s, int64_t h0, int64_t h1, int64_t G, int64_t D, int64_t row,
                           float sc, float* scores, int64_t len) {
  for (int64_t j = 0; j < s.count; ++j) {
    const float* kt = s.k + j * row;
    for (int64_t h = h0; h < h1; ++h) {
      const float* kh = kt + (h / G) * D;
      const float* qh = q + h * D;
      float acc = 0.f;
#pragma omp simd reduction(+:acc)
      for (int64_t i = 0; i < D; ++i) acc += qh[i] * kh[i];
      scores[h * len + s.t0 + j] = acc * sc;
    }
  }
}

static void seg_values_any(const float* scores, const Seg& s, int64_t h0, int64_t h1, int64_t G, int64_t D, int64_t row,
                           float* acc, int64_t len) {
  for (int64_t j = 0; j < s.count; ++j) {
    const float* vt = s.v + j * row;
    for (int64_t h = h0; h < h1; ++h) {
      const float p = scores[h * len + s.t0 + j];
      const float* vh = vt + (h / G) * D;
      float* a = acc + h * D;
#pragma omp simd
      for (int64_t i = 0; i < D; ++i) a[i] += p * vh[i];
    }
  }
}

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
  // One task per sequence; with fewer sequences than threads (single-stream decode), one per
  // sequence and kv head (its GQA group of query heads), so every thread has a share.
  const int64_t split = B < at::get_num_threads() ? KVH : 1;
  tidal_pool::run_tasks(B * split, [&](int64_t task) {
    thread_local std::vector<float> scores;
    thread_local std::vector<Seg> segs;
    const int64_t b = task / split;
    const int64_t g0 = split == 1 ? 0 : task % split, g1 = split == 1 ? KVH : g0 + 1;
    {
      const int64_t n = cp[b];
      const int64_t first = (window > 0 && n > window) ? n - window : 0;
      const int64_t len = n - first;
      scores.resize(H * len);
      const float* qb = qp + b * H * D;
      float* acc = op + b * H * D;
      std::fill(acc + g0 * G * D, acc + g1 * G * D, 0.f);
      segments(tp + b * NB, first, n, BS, row, kp, vp, segs);
      for (const Seg& s : segs) {
        switch (D) {
#ifdef TIDAL_AVX2
          case 8: seg_scores<1>(qb, s, g0, g1, G, row, sc, scores.data(), len); break;
          case 16: seg_scores<2>(qb, s, g0, g1, G, row, sc, scores.data(), len); break;
          case 32: seg_scores<4>(qb, s, g0, g1, G, row, sc, scores.data(), len); break;
          case 64: seg_scores<8>(qb, s, g0, g1, G, row, sc, scores.data(), len); break;
          case 128: seg_scores<16>(qb, s, g0, g1, G, row, sc, scores.data(), len); break;
#endif
          default: seg_scores_any(qb, s, g0 * G, g1 * G, G, D, row, sc, scores.data(), len);
        }
      }
      for (int64_t h = g0 * G; h < g1 * G; ++h) {
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
      for (const Seg& s : segs) {
        switch (D) {
#ifdef TIDAL_AVX2
          case 8: seg_values<1>(scores.data(), s, g0, g1, G, row, acc, len); break;
          case 16: seg_values<2>(scores.data(), s, g0, g1, G, row, acc, len); break;
          case 32: seg_values<4>(scores.data(), s, g0, g1, G, row, acc, len); break;
          case 64: seg_values<8>(scores.data(), s, g0, g1, G, row, acc, len); break;
          case 128: seg_values<16>(scores.data(), s, g0, g1, G, row, acc, len); break;
#endif
          default: seg_values_any(scores.data(), s, g0 * G, g1 * G, G, D, row, acc, len);
        }
      }
    }
  });
  return out;
}

""" + cpu_matvec.SOURCE + cpu_decode.SOURCE + r"""
TORCH_LIBRARY(NAMESPACE, m) {
  m.def("paged_decode", &paged_decode);
  register_matvec(m);
  register_decode(m);
}
"""
_FLAGS = ["-O3", "-march=native", "-ffast-math", "-fopenmp-simd"]
_kernel: Callable[..., torch.Tensor] | None = None
_ops: object | None = None  # torch.ops.<name>: paged_decode and cpu_matvec's ops
_tried = False


def _namespace() -> str:
    return cpu_kernel_build.kernel_name("tidal_cpu_attn", _SOURCE, _FLAGS)


def pending() -> bool:
    """True when the kernel is wanted here but not built yet (cheap: no torch import)."""
    return cpu_kernel_build.enabled() and not cpu_kernel_build.built(_namespace())


def paged_decode_kernel() -> Callable[..., torch.Tensor] | None:
    """The compiled kernel, loaded (built if missing) once per process (None: use the torch path)."""
    global _kernel, _ops, _tried
    if _tried:
        return _kernel
    _tried = True
    if not cpu_kernel_build.enabled():
        return None
    name = _namespace()
    try:
        import torch

        cpu_kernel_build.build_and_load(name, _SOURCE.replace("NAMESPACE", name), _FLAGS, ["-lmvec"])
        _ops = getattr(torch.ops, name)
        _kernel = _ops.paged_decode
    except Exception as exc:  # no compiler, headers or libmvec: the torch path still works
        log.warning("CPU paged attention kernel unavailable, using torch (install g++ and ninja, "
                    "or set TIDAL_CPU_KERNELS=0): %s", exc)
        _kernel = None
    return _kernel


def cpu_ops() -> object | None:
    """The library's op namespace (`paged_decode`, cpu_matvec's `small_linear` ...), or None."""
    paged_decode_kernel()
    return _ops


def supported(q: torch.Tensor) -> bool:
    import torch

    return q.device.type == "cpu" and q.dtype == torch.float32 and paged_decode_kernel() is not None


def main(argv: list[str] | None = None) -> int:
    """`python -m gpu_ext.cpu_attention --build`: build it now (install time), say where or why not.

    Exits 0 either way: without a compiler the workers still serve, on the slower torch path."""
    args = sys.argv[1:] if argv is None else argv
    if args != ["--build"]:
        print("usage: python -m gpu_ext.cpu_attention --build", file=sys.stderr)
        return 2
    if not cpu_kernel_build.enabled():
        print("tidal: TIDAL_CPU_KERNELS=0: the CPU attention kernel is off (the torch path serves)")
        return 0
    name = _namespace()
    if cpu_kernel_build.built(name):
        print(f"tidal: CPU attention kernel already built: {cpu_kernel_build.library_path(name)}")
        return 0
    print(f"tidal: building the CPU attention kernel once for this venv (C++ compiler, ~10-90 s) "
          f"into {cpu_kernel_build.library_path(name).parent}", flush=True)
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    if paged_decode_kernel() is None:
        print("tidal: warning: the CPU attention kernel did not build (see above); workers use the slower "
              "torch path. Install a C++ compiler (g++) to get it, or set TIDAL_CPU_KERNELS=0 to skip it.")
        return 0
    print(f"tidal: CPU attention kernel built: {cpu_kernel_build.library_path(name)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
