"""C++ source of a whole decode step's layers in one call: `decode_layers`.

A single-stream decode step of SmolLM2 made, per layer, a C++ call for norm + qkv + rope
(`rms_qkv_rope`), two `index_copy_` for the new token's K and V, the attention kernel
(`paged_decode`) and a C++ call for o_proj + MLP (`rms_mlp`), with Python between them: measured
on the 2-core dev box (1 thread, thread CPU time per step of 30 layers, busy box) 1.9 ms for the
KV writes and ~4 ms of Python and dispatch around the calls, against ~45 ms for the whole step.
`decode_layers` runs a range of layers' loop in C++: those same functions in the same order (the
same bits), the KV write a row copy per token and layer.

Inputs: `hidden` [T, H] (T <= cpu_matvec.MAX_ROWS, every token a decode), per layer its weights as
lists in layer order (`bqkv` empty when the model has no qkv bias), cos/sin [T, 1, D] of
`RotaryTable.lookup_full`, the K and V caches [blocks, block_size, kv_heads, D], `slots` [L, T]
(each new token's cache slot per layer), `tables` [L, T, NB] and `ctx` [T] as `paged_decode`
takes them per layer. Compiled into gpu_ext.cpu_attention's library after cpu_matvec's source
(it calls `paged_decode`, `rms_qkv_rope` and `rms_mlp`); registered by `register_decode(m)`.
"""
from __future__ import annotations

SOURCE = r"""
#include <cstring>

static void check_list(at::TensorList t, int64_t n, const char* what) {
  TORCH_CHECK(static_cast<int64_t>(t.size()) == n, "decode_layers: ", what, " must hold one tensor per layer (", n,
              "), got ", t.size());
}

at::Tensor decode_layers(const at::Tensor& hidden_in, at::TensorList input_norm, at::TensorList wqkv, at::TensorList bqkv,
                         at::TensorList wo, at::TensorList post_norm, at::TensorList w13, at::TensorList w2, double eps,
                         const at::Tensor& cos, const at::Tensor& sin, int64_t heads, int64_t kv_heads, int64_t dim,
                         const at::Tensor& kc, const at::Tensor& vc, const at::Tensor& slots, const at::Tensor& tables,
                         const at::Tensor& ctx, double scale, int64_t window) {
  const int64_t L = static_cast<int64_t>(wqkv.size()), T = hidden_in.size(0);
  check_list(input_norm, L, "input_norm");
  check_list(wo, L, "wo");
  check_list(post_norm, L, "post_norm");
  check_list(w13, L, "w13");
  check_list(w2, L, "w2");
  TORCH_CHECK(bqkv.empty() || static_cast<int64_t>(bqkv.size()) == L, "decode_layers: bqkv must be empty or one per layer");
  TORCH_CHECK(kc.dim() == 4 && vc.sizes() == kc.sizes() && kc.is_contiguous() && vc.is_contiguous() &&
              kc.scalar_type() == at::kFloat && vc.scalar_type() == at::kFloat && kc.size(2) == kv_heads &&
              kc.size(3) == dim, "decode_layers: K/V caches must be contiguous fp32 [blocks, block_size, kv_heads, dim]");
  TORCH_CHECK(slots.dim() == 2 && slots.size(0) == L && slots.size(1) == T && slots.is_contiguous() &&
              slots.scalar_type() == at::kLong, "decode_layers: slots must be contiguous int64 [layers, tokens]");
  TORCH_CHECK(tables.dim() == 3 && tables.size(0) == L && tables.size(1) == T && tables.is_contiguous() &&
              tables.scalar_type() == at::kLong, "decode_layers: tables must be contiguous int64 [layers, tokens, blocks]");
  TORCH_CHECK(ctx.numel() == T && ctx.is_contiguous() && ctx.scalar_type() == at::kLong,
              "decode_layers: ctx must be contiguous int64 [tokens]");
  const int64_t row = kv_heads * dim, nslots = kc.size(0) * kc.size(1);
  const int64_t* sp = slots.data_ptr<int64_t>();
  for (int64_t i = 0; i < L * T; ++i)
    TORCH_CHECK(sp[i] >= 0 && sp[i] < nslots, "decode_layers: slot ", sp[i], " outside the cache (", nslots, ")");
  float* kp = kc.data_ptr<float>();
  float* vp = vc.data_ptr<float>();
  at::Tensor hidden = hidden_in;
  for (int64_t l = 0; l < L; ++l) {
    std::optional<at::Tensor> bias;
    if (!bqkv.empty()) bias = bqkv[l];
    auto [q, k, v] = rms_qkv_rope(hidden, input_norm[l], eps, wqkv[l], bias, cos, sin, heads, kv_heads, dim);
    // the new tokens' K and V into their slots (PagedKVCache.write), then attention over the cache
    const float* kn = k.data_ptr<float>();
    const float* vn = v.data_ptr<float>();
    for (int64_t t = 0; t < T; ++t) {
      const int64_t s = sp[l * T + t];
      std::memcpy(kp + s * row, kn + t * k.stride(0), row * sizeof(float));
      std::memcpy(vp + s * row, vn + t * v.stride(0), row * sizeof(float));
    }
    auto attn = paged_decode(q.contiguous(), kc, vc, tables.select(0, l), ctx, scale, window);
    hidden = rms_mlp(attn.view({T, heads * dim}), wo[l], hidden, post_norm[l], eps, w13[l], w2[l]);
  }
  return hidden;
}

static void register_decode(torch::Library& m) {
  m.def("decode_layers", &decode_layers);
}
"""
