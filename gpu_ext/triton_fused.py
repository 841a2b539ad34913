"""Fused elementwise stages of a Llama layer for CUDA, in Triton.

Measured on an H200 (docs/gpu.md): with the decode step in one CUDA graph and the attention
reading the blocks at the HBM's rate, a step still took ~3-5 ms over its roofline at every
batch size: the ~40 small kernels per layer that torch launches for RMSNorm (fp32 upcast,
square, mean, rsqrt, scale, downcast, weight), rotary embedding (halves, four products, add,
sub, concat; for q and k) and SwiGLU, each a few microseconds of launch and tail. Each stage
here is one kernel:

* `rms_norm(x, w, eps, residual)`: optionally `h = x + residual` first (returned: the next
  residual), then transformers' LlamaRMSNorm on `h`;
* `rope_qk(qkv, ...)`: the rotary embedding of q and k straight out of the fused qkv
  projection, cos/sin looked up by position in the same kernel (position < 0: a padding row);
* `silu_mul(gate_up)`: SiLU(gate) * up.

Each rounds where torch rounds (the model's dtype after each torch op), so results match the
unfused ops up to the order of the fp32 mean. Only CUDA paths import this module (and the
interpreter test on CPU).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rms_norm_kernel(X, Res, W, Out, ResOut, n, eps, stride_x, stride_r, stride_o, stride_ro,
                     BLOCK: tl.constexpr, HAS_RES: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < n
    x = tl.load(X + row * stride_x + offs, mask=mask, other=0.0)
    if HAS_RES:
        h = (x.to(tl.float32) + tl.load(Res + row * stride_r + offs, mask=mask, other=0.0).to(tl.float32))
        h = h.to(x.dtype)
        tl.store(ResOut + row * stride_ro + offs, h, mask=mask)
    else:
        h = x
    hf = h.to(tl.float32)
    inv = 1.0 / tl.sqrt(tl.sum(hf * hf, 0) / n + eps)
    normed = (hf * inv).to(x.dtype).to(tl.float32)
    w = tl.load(W + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(Out + row * stride_o + offs, (normed * w).to(Out.dtype.element_ty), mask=mask)


@triton.jit
def _rope_qk_kernel(QKV, Cos, Sin, Pos, Q, K, stride_t, max_pos,
                    HEADS: tl.constexpr, KV_HEADS: tl.constexpr, H_PAD: tl.constexpr,
                    HALF: tl.constexpr, HALF_PAD: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    pos = tl.load(Pos + t)
    pos = tl.where(pos < 0, pos + max_pos, pos)  # padding rows read a valid row (as torch's -1 does)
    offs_h = tl.arange(0, H_PAD)
    offs_d = tl.arange(0, HALF_PAD)
    mask_d = offs_d < HALF
    cos = tl.load(Cos + pos * HALF + offs_d, mask=mask_d, other=0.0)[None, :].to(tl.float32)
    sin = tl.load(Sin + pos * HALF + offs_d, mask=mask_d, other=0.0)[None, :].to(tl.float32)
    for part in tl.static_range(2):
        if part == 0:
            heads = HEADS
            src = QKV + t * stride_t
            dst = Q + t * HEADS * 2 * HALF
        else:
            heads = KV_HEADS
            src = QKV + t * stride_t + HEADS * 2 * HALF
            dst = K + t * KV_HEADS * 2 * HALF
        mask = (offs_h[:, None] < heads) & mask_d[None, :]
        at = offs_h[:, None] * 2 * HALF + offs_d[None, :]
        x1 = tl.load(src + at, mask=mask, other=0.0)
        x2 = tl.load(src + at + HALF, mask=mask, other=0.0)
        dt = x1.dtype
        a = x1.to(tl.float32)
        b = x2.to(tl.float32)
        # torch rounds each product, then the sum, to the model's dtype
        lo = (a * cos).to(dt).to(tl.float32) - (b * sin).to(dt).to(tl.float32)
        hi = (b * cos).to(dt).to(tl.float32) + (a * sin).to(dt).to(tl.float32)
        tl.store(dst + at, lo.to(dt), mask=mask)
        tl.store(dst + at + HALF, hi.to(dt), mask=mask)


@triton.jit
def _silu_mul_kernel(GU, Out, inter, stride_g, stride_o, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < inter
    g = tl.load(GU + row * stride_g + offs, mask=mask, other=0.0)
    u = tl.load(GU + row * stride_g + inter + offs, mask=mask, other=0.0)
    gf = g.to(tl.float32)
    s = (gf / (1.0 + tl.exp(-gf))).to(g.dtype).to(tl.float32)
    tl.store(Out + row * stride_o + offs, (s * u.to(tl.float32)).to(g.dtype), mask=mask)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, H] (+ residual [T, H]) → (RMSNorm(h) * weight, h) with h = x (+ residual)."""
    t, n = x.shape
    out = torch.empty_like(x)
    res_out = torch.empty_like(x) if residual is not None else x
    if t:
        res = residual if residual is not None else x
        _rms_norm_kernel[(t,)](x, res, weight, out, res_out, n, eps, x.stride(0), res.stride(0), out.stride(0),
                               res_out.stride(0), BLOCK=triton.next_power_of_2(n), HAS_RES=residual is not None,
                               num_warps=8 if n >= 4096 else 4)
    return out, res_out


def rope_qk(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor, heads: int,
            kv_heads: int, head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """qkv [T, (heads + 2 kv_heads) * head_dim] (last dim contiguous); cos/sin tables [max_pos,
    head_dim / 2]; positions [T] → q [T, heads, head_dim], k [T, kv_heads, head_dim], rotated."""
    t = qkv.shape[0]
    if qkv.stride(-1) != 1 or not cos.is_contiguous() or not sin.is_contiguous():
        raise ValueError("rope_qk: qkv needs a contiguous last dimension, cos/sin contiguous tables")
    q = torch.empty(t, heads, head_dim, dtype=qkv.dtype, device=qkv.device)
    k = torch.empty(t, kv_heads, head_dim, dtype=qkv.dtype, device=qkv.device)
    if t:
        half = head_dim // 2
        _rope_qk_kernel[(t,)](qkv, cos, sin, positions, q, k, qkv.stride(0), cos.shape[0], HEADS=heads,
                              KV_HEADS=kv_heads, H_PAD=triton.next_power_of_2(heads), HALF=half,
                              HALF_PAD=triton.next_power_of_2(half), num_warps=4)
    return q, k


def silu_mul(gate_up: torch.Tensor, inter: int) -> torch.Tensor:
    """gate_up [T, 2 * inter] (gate then up) → SiLU(gate) * up [T, inter]."""
    t = gate_up.shape[0]
    out = torch.empty(t, inter, dtype=gate_up.dtype, device=gate_up.device)
    if t:
        block = 1024
        _silu_mul_kernel[(t, triton.cdiv(inter, block))](gate_up, out, inter, gate_up.stride(0), out.stride(0),
                                                         BLOCK=block, num_warps=4)
    return out
