"""C++ source of the CPU decode projections: y = x W^T for a few rows, with what surrounds them fused.

A decode step multiplies one row per sequence by every weight: bound by reading the weight from
memory once. These loops read one weight row after another against every x row with FMAs, so the
weight is a single sequential stream that the hardware prefetcher follows (an earlier version read
4 rows side by side with software prefetch 16 rows ahead: 4 interleaved streams; measured 1 thread
on the loaded 2-core dev box, SmolLM2-135M's 121 projections + lm_head, 538 MB, thread CPU time per
step, interleaved: 56.4 -> 46.4 ms; MKL's gemv through `F.linear` took ~30% more than the earlier
version). Tasks of 16 weight rows are spread over `torch.get_num_threads()` threads by
gpu_ext/cpu_pool.py's pool (the caller is one of them; a late worker never holds a call up).
What a decode layer does around its projections is folded in, one
call instead of 3-7 torch ops each:

- `rms_small_linear(x, norm_w, eps, w, bias)`: RMSNorm of each row (fp32), then x W^T (+ bias);
- `small_linear(x, w, bias, residual)`: x W^T (+ bias) (+ residual) (o_proj with its residual);
- `silu_small_linear(gate_up, w, residual)`: silu(gate) * up, then times W^T (+ residual);
- `rope_qk(qkv, cos, sin, heads, dim)`: the rotary embedding of q and k, read from qkv (models/llama.py's
  `apply_rope_full` in one call instead of 7 ops);
- `rms_qkv_rope(x, norm_w, eps, wqkv, bqkv, cos, sin, heads, kv_heads, dim)`: a layer's whole
  pre-attention (norm, qkv, rope of q and k in place) as q, k, v views of one buffer;
- `rms_mlp(attn, wo, residual, post_norm, eps, w13, w2)`: a layer's whole post-attention (o_proj +
  residual, norm, gate|up, SiLU-gate, down + residual), the three calls above in one.

A decode step of SmolLM2 makes 2 calls per layer instead of 5 (and none of the Python slicing
between them).

fp32, contiguous, at most `MAX_ROWS` rows (more rows are compute-bound: oneDNN/MKL win there).
The sums run in another order than MKL's, so results differ from `F.linear` in the last bits.
Compiled into gpu_ext.cpu_attention's library (one build, one load): `SOURCE` goes before its
`TORCH_LIBRARY` block, which calls `register_matvec(m)`.
"""
from __future__ import annotations

MAX_ROWS = 4

SOURCE = r"""
#include <ATen/ops/empty.h>
#include <ATen/ops/from_blob.h>
#include <cstdlib>
#include <optional>
#include <tuple>
#include <sys/mman.h>

// y[m, n] = sum_k x[m, k] w[n, k] (+ bias[n]) (+ res[m, n]) for rows n in [n0, n1), one weight row
// after another: the weight is read as one sequential stream, the hardware prefetcher's best case
// (no software prefetch), with A independent accumulators per x row over k.
template <int M, int A>
static void mv_seq(const float* __restrict x, const float* __restrict w, float* __restrict y,
                   int64_t n0, int64_t n1, int64_t K, int64_t N, const float* bias, const float* res) {
#ifdef TIDAL_AVX2
  for (int64_t n = n0; n < n1; ++n) {
    const float* wr = w + n * K;
    __m256 acc[M][A];
    for (int m = 0; m < M; ++m) for (int a = 0; a < A; ++a) acc[m][a] = _mm256_setzero_ps();
    int64_t k = 0;
    for (; k + 8 * A <= K; k += 8 * A)
      for (int a = 0; a < A; ++a) {
        const __m256 wv = _mm256_loadu_ps(wr + k + 8 * a);
        for (int m = 0; m < M; ++m) acc[m][a] = _mm256_fmadd_ps(wv, _mm256_loadu_ps(x + m * K + k + 8 * a), acc[m][a]);
      }
    for (; k + 8 <= K; k += 8) {
      const __m256 wv = _mm256_loadu_ps(wr + k);
      for (int m = 0; m < M; ++m) acc[m][0] = _mm256_fmadd_ps(wv, _mm256_loadu_ps(x + m * K + k), acc[m][0]);
    }
    for (int m = 0; m < M; ++m) {
      for (int a = 1; a < A; ++a) acc[m][0] = _mm256_add_ps(acc[m][0], acc[m][a]);
      float s = hsum(acc[m][0]);
      for (int64_t kk = k; kk < K; ++kk) s += x[m * K + kk] * wr[kk];
      if (bias) s += bias[n];
      y[m * N + n] = res ? res[m * N + n] + s : s;
    }
  }
#else
  for (int64_t n = n0; n < n1; ++n)
    for (int m = 0; m < M; ++m) {
      float s = 0.f;
      for (int64_t k = 0; k < K; ++k) s += x[m * K + k] * w[n * K + k];
      if (bias) s += bias[n];
      y[m * N + n] = res ? res[m * N + n] + s : s;
    }
#endif
}

static void mv_rows(const float* x, int64_t M, int64_t K, const float* w, int64_t N, const float* bias,
                    const float* res, float* y) {
  // Tasks of BLOCK weight rows (16 x 576 fp32: 36 KiB, a few microseconds): SmolLM2's narrowest
  // projections (576 rows) make 36 tasks, enough for the threads to even out.
  constexpr int64_t BLOCK = 16;
  const int64_t tasks = (N + BLOCK - 1) / BLOCK;
  tidal_pool::run_tasks(tasks, [&](int64_t t) {
    const int64_t n0 = t * BLOCK, n1 = std::min(N, n0 + BLOCK);
    switch (M) {
      case 1: mv_seq<1, 4>(x, w, y, n0, n1, K, N, bias, res); break;
      case 2: mv_seq<2, 4>(x, w, y, n0, n1, K, N, bias, res); break;
      case 3: mv_seq<3, 2>(x, w, y, n0, n1, K, N, bias, res); break;
      default: mv_seq<4, 2>(x, w, y, n0, n1, K, N, bias, res); break;
    }
  });
}

static const float* opt_ptr(const std::optional<at::Tensor>& t, int64_t numel) {
  if (!t.has_value() || !t->defined()) return nullptr;
  TORCH_CHECK(t->is_contiguous() && t->scalar_type() == at::kFloat && t->numel() == numel,
              "matvec: bias/residual must be contiguous fp32 of ", numel, " values");
  return t->data_ptr<float>();
}

static void check_mv(const at::Tensor& x, const at::Tensor& w, int64_t K) {
  TORCH_CHECK(x.dim() == 2 && x.size(0) >= 1 && x.size(0) <= 4, "matvec: x must be [1..4, K]");
  TORCH_CHECK(w.dim() == 2 && w.size(1) == K, "matvec: w must be [N, ", K, "]");
  TORCH_CHECK(x.is_contiguous() && w.is_contiguous() && x.scalar_type() == at::kFloat && w.scalar_type() == at::kFloat,
              "matvec: contiguous fp32 tensors only");
}

at::Tensor small_linear(const at::Tensor& x, const at::Tensor& w, const std::optional<at::Tensor>& bias,
                        const std::optional<at::Tensor>& residual) {
  check_mv(x, w, x.size(1));
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  auto y = at::empty({M, N}, x.options());
  mv_rows(x.data_ptr<float>(), M, K, w.data_ptr<float>(), N, opt_ptr(bias, N), opt_ptr(residual, M * N),
          y.data_ptr<float>());
  return y;
}

at::Tensor rms_small_linear(const at::Tensor& x, const at::Tensor& norm_w, double eps, const at::Tensor& w,
                            const std::optional<at::Tensor>& bias) {
  check_mv(x, w, x.size(1));
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  TORCH_CHECK(norm_w.is_contiguous() && norm_w.numel() == K && norm_w.scalar_type() == at::kFloat);
  std::vector<float> xn(M * K);
  const float* xp = x.data_ptr<float>();
  const float* nw = norm_w.data_ptr<float>();
  for (int64_t m = 0; m < M; ++m) {
    const float* r = xp + m * K;
    float ss = 0.f;
    for (int64_t k = 0; k < K; ++k) ss += r[k] * r[k];
    const float inv = 1.f / std::sqrt(ss / static_cast<float>(K) + static_cast<float>(eps));
    for (int64_t k = 0; k < K; ++k) xn[m * K + k] = r[k] * inv * nw[k];
  }
  auto y = at::empty({M, N}, x.options());
  mv_rows(xn.data(), M, K, w.data_ptr<float>(), N, opt_ptr(bias, N), nullptr, y.data_ptr<float>());
  return y;
}

at::Tensor silu_small_linear(const at::Tensor& gate_up, const at::Tensor& w, const std::optional<at::Tensor>& residual) {
  const int64_t M = gate_up.size(0), I = gate_up.size(1) / 2, N = w.size(0);
  TORCH_CHECK(gate_up.size(1) == 2 * I, "silu_small_linear: gate_up must be [M, 2 I]");
  check_mv(gate_up, w, I);
  std::vector<float> act(M * I);
  const float* g = gate_up.data_ptr<float>();
  for (int64_t m = 0; m < M; ++m)
    for (int64_t i = 0; i < I; ++i) {
      const float a = g[m * 2 * I + i];
      act[m * I + i] = a / (1.f + std::exp(-a)) * g[m * 2 * I + I + i];
    }
  auto y = at::empty({M, N}, gate_up.options());
  mv_rows(act.data(), M, I, w.data_ptr<float>(), N, nullptr, opt_ptr(residual, M * N), y.data_ptr<float>());
  return y;
}

// A decode layer's attention input in one call (models/llama.py's pre_attention): RMSNorm + the
// fused q|k|v projection (rms_small_linear), then the rotary embedding of q and k in place
// (rope_qk's arithmetic: x * cos + roll(x, dim / 2) * sin). Returns views of one [T, (H + 2 KVH) D]
// buffer: q [T, H, D], k and v [T, KVH, D].
std::tuple<at::Tensor, at::Tensor, at::Tensor> rms_qkv_rope(
    const at::Tensor& x, const at::Tensor& norm_w, double eps, const at::Tensor& wqkv,
    const std::optional<at::Tensor>& bias, const at::Tensor& cos, const at::Tensor& sin, int64_t heads,
    int64_t kv_heads, int64_t dim) {
  auto qkv = rms_small_linear(x, norm_w, eps, wqkv, bias);
  const int64_t T = qkv.size(0), W = qkv.size(1), half = dim / 2, rot = heads + kv_heads;
  TORCH_CHECK(W == (heads + 2 * kv_heads) * dim && dim % 2 == 0, "rms_qkv_rope: wqkv must have (heads + 2 kv_heads) * dim rows");
  TORCH_CHECK(cos.is_contiguous() && sin.is_contiguous() && cos.numel() == T * dim && sin.numel() == T * dim,
              "rms_qkv_rope: cos/sin must be contiguous [T, 1, dim]");
  float* xp = qkv.data_ptr<float>();
  const float* cp = cos.data_ptr<float>();
  const float* sp = sin.data_ptr<float>();
  std::vector<float> head(dim);
  for (int64_t t = 0; t < T; ++t)
    for (int64_t h = 0; h < rot; ++h) {
      float* o = xp + t * W + h * dim;
      const float* c = cp + t * dim;
      const float* s = sp + t * dim;
      std::copy(o, o + dim, head.begin());
      for (int64_t i = 0; i < dim; ++i) o[i] = head[i] * c[i] + head[i < half ? i + half : i - half] * s[i];
    }
  return {qkv.narrow(1, 0, heads * dim).view({T, heads, dim}),
          qkv.narrow(1, heads * dim, kv_heads * dim).view({T, kv_heads, dim}),
          qkv.narrow(1, (heads + kv_heads) * dim, kv_heads * dim).view({T, kv_heads, dim})};
}

// A decode layer after its attention in one call (post_attention): hidden = residual + attn Wo^T,
// then hidden + down(silu(gate) * up) of RMSNorm(hidden): small_linear, rms_small_linear and
// silu_small_linear in that order, the same bits.
at::Tensor rms_mlp(const at::Tensor& attn, const at::Tensor& wo, const at::Tensor& residual, const at::Tensor& post_norm,
                   double eps, const at::Tensor& w13, const at::Tensor& w2) {
  auto hidden = small_linear(attn, wo, std::nullopt, residual);
  auto gate_up = rms_small_linear(hidden, post_norm, eps, w13, std::nullopt);
  return silu_small_linear(gate_up, w2, hidden);
}

// Copies of `tensors` in one allocation aligned to 2 MiB that the kernel is asked to back with
// transparent huge pages (madvise): a decode step streams every weight once, and with 4 KiB
// pages that walk misses the TLB every 4 KiB. Views of one storage, freed with the last of them.
std::vector<at::Tensor> to_hugepages(const std::vector<at::Tensor>& tensors) {
  constexpr int64_t HUGE = 2 << 20, ALIGN = 64;
  int64_t total = 0;
  for (const auto& t : tensors) total += (t.numel() * t.element_size() + ALIGN - 1) / ALIGN * ALIGN;
  const int64_t bytes = std::max<int64_t>(HUGE, (total + HUGE - 1) / HUGE * HUGE);
  void* p = std::aligned_alloc(HUGE, bytes);
  TORCH_CHECK(p != nullptr, "to_hugepages: out of memory for ", bytes, " bytes");
  madvise(p, bytes, MADV_HUGEPAGE);  // advice only: without THP the pages stay 4 KiB
  auto arena = at::from_blob(p, {bytes}, [](void* q) { std::free(q); }, at::TensorOptions().dtype(at::kByte));
  std::vector<at::Tensor> out;
  int64_t off = 0;
  for (const auto& t : tensors) {
    const int64_t n = t.numel() * t.element_size();
    auto view = arena.narrow(0, off, n).view(t.scalar_type()).view(t.sizes());
    view.copy_(t);
    out.push_back(view);
    off += (n + ALIGN - 1) / ALIGN * ALIGN;
  }
  return out;
}

// Rotary embedding of q and k together (`apply_rope_full` of models/llama.py in one call):
// qkv [T, (H + 2 KVH) D]; cos, sin [T, 1, D] (cos twice, sin with its first half negated);
// out [T, H + KVH, D]: x * cos + roll(x, D / 2) * sin for the first H + KVH heads of each row.
at::Tensor rope_qk(const at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin, int64_t heads, int64_t dim) {
  const int64_t T = qkv.size(0), W = qkv.size(1), half = dim / 2;
  TORCH_CHECK(qkv.dim() == 2 && qkv.stride(1) == 1 && qkv.scalar_type() == at::kFloat && heads * dim <= W,
              "rope_qk: qkv must be fp32 [T, >= heads * dim] with unit inner stride");
  TORCH_CHECK(cos.is_contiguous() && sin.is_contiguous() && cos.numel() == T * dim && sin.numel() == T * dim,
              "rope_qk: cos/sin must be contiguous [T, 1, dim]");
  auto out = at::empty({T, heads, dim}, qkv.options());
  const float* xp = qkv.data_ptr<float>();
  const float* cp = cos.data_ptr<float>();
  const float* sp = sin.data_ptr<float>();
  float* op = out.data_ptr<float>();
  for (int64_t t = 0; t < T; ++t)
    for (int64_t h = 0; h < heads; ++h) {
      const float* x = xp + t * qkv.stride(0) + h * dim;
      const float* c = cp + t * dim;
      const float* s = sp + t * dim;
      float* o = op + (t * heads + h) * dim;
      for (int64_t i = 0; i < dim; ++i) o[i] = x[i] * c[i] + x[i < half ? i + half : i - half] * s[i];
    }
  return out;
}

static void register_matvec(torch::Library& m) {
  m.def("rope_qk", &rope_qk);
  m.def("rms_qkv_rope", &rms_qkv_rope);
  m.def("rms_mlp", &rms_mlp);
  m.def("to_hugepages", &to_hugepages);
  m.def("small_linear", &small_linear);
  m.def("rms_small_linear", &rms_small_linear);
  m.def("silu_small_linear", &silu_small_linear);
}
"""
