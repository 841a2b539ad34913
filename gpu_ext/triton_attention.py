"""Paged decode attention for CUDA in Triton: reads K/V from the blocks in place.

The torch path gathers each sequence's blocks into a padded copy and runs SDPA over it
(three passes over the KV plus padding). `paged_decode` walks each sequence's block table
inside the kernel and reads every K and V row once:

* one program per (sequence, kv head, split): the GQA group's query heads are the rows of
  one tile, so a K/V tile is loaded once for all of them (rows padded to 16 for `tl.dot`);
* split-K for long contexts with few sequences: the context is cut into `num_splits`
  ranges (from the sequence's own length, read on the device, so one launch shape fits
  any context: what CUDA graphs need); each writes its partial output and log-sum-exp,
  and a second kernel merges them;
* `rows` (optional) maps a batch row to its block-table row, so a table kept in a static
  buffer across steps (engine/cuda_graphs.py) need not be reordered;
* a context length of 0 marks a padding row: its output is zeros.

`write_kv` stores a step's new K/V at the slot its block table and position give
(position < 0: a padding row, nothing written), for the same static tables.

This module imports Triton: only CUDA paths (and the interpreter test, TRITON_INTERPRET=1
on CPU tensors) import it.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

MIN_TOKENS_PER_SPLIT = 256  # a split that reads less costs more in its merge than it saves
MAX_SPLITS = 32
# The split count is a run-time argument (one compiled kernel serves every count); only
# whether there is more than one is compiled in.


@triton.jit
def _paged_decode_kernel(
    Q, K, V, Tables, Rows, CtxLens, Out, PartOut, PartLse,
    scale, window, num_splits,
    stride_qb, stride_qh,
    stride_kn, stride_kt, stride_kh,
    stride_vn, stride_vt, stride_vh,
    stride_tr, stride_tp,
    stride_ob, stride_oh,
    stride_pb, stride_ph, stride_ps,
    stride_lb, stride_lh,
    GROUP: tl.constexpr, G_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, SPLIT: tl.constexpr,
    HAS_ROWS: tl.constexpr, IS_FP32: tl.constexpr,
):
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    ctx = tl.load(CtxLens + b).to(tl.int32)
    lo = tl.where(window > 0, tl.maximum(ctx - window, 0), 0)
    span = tl.maximum(ctx - lo, 0)
    per_split = ((span + num_splits - 1) // num_splits + BLOCK_N - 1) // BLOCK_N * BLOCK_N
    start = lo + split * per_split
    end = tl.minimum(start + per_split, ctx)
    if HAS_ROWS:
        row = tl.load(Rows + b).to(tl.int64)
    else:
        row = b.to(tl.int64)

    offs_g = tl.arange(0, G_PAD)
    offs_d = tl.arange(0, D_PAD)
    offs_n = tl.arange(0, BLOCK_N)
    heads = kvh * GROUP + offs_g
    mask_g = offs_g < GROUP
    mask_d = offs_d < HEAD_DIM
    q = tl.load(Q + b.to(tl.int64) * stride_qb + heads[:, None] * stride_qh + offs_d[None, :],
                mask=mask_g[:, None] & mask_d[None, :], other=0.0)

    m_i = tl.full([G_PAD], -1.0e30, dtype=tl.float32)  # finite: an empty range stays NaN-free
    l_i = tl.zeros([G_PAD], dtype=tl.float32)
    acc = tl.zeros([G_PAD, D_PAD], dtype=tl.float32)
    for s in range(start, end, BLOCK_N):
        toks = s + offs_n
        mask_n = toks < end
        blk = tl.load(Tables + row * stride_tr + (toks // BLOCK_SIZE) * stride_tp, mask=mask_n, other=0).to(tl.int64)
        within = toks % BLOCK_SIZE
        kv_mask = mask_n[:, None] & mask_d[None, :]
        k = tl.load(K + blk[:, None] * stride_kn + within[:, None] * stride_kt + kvh * stride_kh + offs_d[None, :],
                    mask=kv_mask, other=0.0)
        v = tl.load(V + blk[:, None] * stride_vn + within[:, None] * stride_vt + kvh * stride_vh + offs_d[None, :],
                    mask=kv_mask, other=0.0)
        if IS_FP32:
            qk = tl.dot(q, tl.trans(k), input_precision="ieee")
        else:
            qk = tl.dot(q, tl.trans(k))
        qk = tl.where(mask_n[None, :], qk * scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(qk - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        if IS_FP32:
            pv = tl.dot(p, v, input_precision="ieee")
        else:
            pv = tl.dot(p.to(v.dtype), v)
        acc = acc * alpha[:, None] + pv
        m_i = m_new

    l_safe = tl.where(l_i > 0, l_i, 1.0)
    out = acc / l_safe[:, None]
    out_mask = mask_g[:, None] & mask_d[None, :]
    if not SPLIT:
        tl.store(Out + b.to(tl.int64) * stride_ob + heads[:, None] * stride_oh + offs_d[None, :],
                 out.to(Out.dtype.element_ty), mask=out_mask)
    else:
        lse = tl.where(l_i > 0, m_i + tl.log(l_safe), float("-inf"))
        base = b.to(tl.int64) * stride_pb + heads * stride_ph + split * stride_ps
        tl.store(PartOut + base[:, None] + offs_d[None, :], out, mask=out_mask)
        tl.store(PartLse + b.to(tl.int64) * stride_lb + heads * stride_lh + split, lse, mask=mask_g)


@triton.jit
def _merge_splits_kernel(
    PartOut, PartLse, Out,
    num_splits, stride_pb, stride_ph, stride_ps, stride_lb, stride_lh, stride_ob, stride_oh,
    HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, S_PAD: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    offs_s = tl.arange(0, S_PAD)
    offs_d = tl.arange(0, D_PAD)
    mask_s = offs_s < num_splits
    mask_d = offs_d < HEAD_DIM
    lse = tl.load(PartLse + b * stride_lb + h * stride_lh + offs_s, mask=mask_s, other=float("-inf"))
    m = tl.max(lse, 0)
    m = tl.where(m == float("-inf"), 0.0, m)  # every split empty: weights 0, output 0
    w = tl.exp(lse - m)
    total = tl.sum(w, 0)
    part = tl.load(PartOut + b * stride_pb + h * stride_ph + offs_s[:, None] * stride_ps + offs_d[None, :],
                   mask=mask_s[:, None] & mask_d[None, :], other=0.0)
    out = tl.sum(part * w[:, None], 0) / tl.where(total > 0, total, 1.0)
    tl.store(Out + b * stride_ob + h * stride_oh + offs_d, out.to(Out.dtype.element_ty), mask=mask_d)


@triton.jit
def _write_kv_kernel(
    Kn, Vn, KC, VC, Tables, Rows, Pos,
    stride_knt, stride_knh, stride_vnt, stride_vnh,
    stride_kn, stride_kt, stride_kh, stride_vn, stride_vt, stride_vh,
    stride_tr, stride_tp,
    KV_HEADS: tl.constexpr, H_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    pos_raw = tl.load(Pos + t)
    valid = pos_raw >= 0
    pos = tl.maximum(pos_raw, 0)
    row = tl.load(Rows + t).to(tl.int64)
    blk = tl.load(Tables + row * stride_tr + (pos // BLOCK_SIZE) * stride_tp, mask=valid, other=0).to(tl.int64)
    within = pos % BLOCK_SIZE
    offs_h = tl.arange(0, H_PAD)
    offs_d = tl.arange(0, D_PAD)
    # the padding rows' test as a full tile (a scalar & a tile is not a boolean tile in every
    # Triton interpreter)
    live = (tl.zeros([H_PAD, D_PAD], dtype=tl.int64) + pos_raw) >= 0
    mask = live & (offs_h[:, None] < KV_HEADS) & (offs_d[None, :] < HEAD_DIM)
    k = tl.load(Kn + t * stride_knt + offs_h[:, None] * stride_knh + offs_d[None, :], mask=mask)
    v = tl.load(Vn + t * stride_vnt + offs_h[:, None] * stride_vnh + offs_d[None, :], mask=mask)
    tl.store(KC + blk * stride_kn + within * stride_kt + offs_h[:, None] * stride_kh + offs_d[None, :], k, mask=mask)
    tl.store(VC + blk * stride_vn + within * stride_vt + offs_h[:, None] * stride_vh + offs_d[None, :], v, mask=mask)


def _pow2(n: int, least: int = 1) -> int:
    return max(least, triton.next_power_of_2(n))


def choose_splits(batch: int, kv_heads: int, max_ctx: int, sm_count: int) -> int:
    """Splits per (sequence, kv head): enough programs for two waves over the SMs, but no
    split shorter than MIN_TOKENS_PER_SPLIT tokens."""
    programs = batch * kv_heads
    if programs >= sm_count:
        return 1
    want = -(-2 * sm_count // programs)
    return max(1, min(want, max_ctx // MIN_TOKENS_PER_SPLIT, MAX_SPLITS))


def paged_decode(
    q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, tables: torch.Tensor, ctx_lens: torch.Tensor,
    scale: float, window: int = 0, *, rows: torch.Tensor | None = None, num_splits: int = 1,
    out: torch.Tensor | None = None, block_n: int | None = None,
) -> torch.Tensor:
    """q [B, H, D]; keys/values [num_blocks, block_size, kv_heads, D] (last dim contiguous);
    tables [R, W] block ids; ctx_lens [B] keys per sequence (0: a padding row); rows [B]
    table row of each batch row (default: row b). Returns [B, H, D] in q's dtype."""
    batch, heads, d = q.shape
    _, block_size, kv_heads, dk = keys.shape
    if dk != d or heads % kv_heads or values.shape != keys.shape:
        raise ValueError(f"paged_decode: q {tuple(q.shape)} does not fit keys {tuple(keys.shape)} / values "
                         f"{tuple(values.shape)}")
    if q.stride(-1) != 1 or keys.stride(-1) != 1 or values.stride(-1) != 1:
        raise ValueError("paged_decode: q, keys and values need a contiguous last dimension")
    if not 1 <= num_splits <= MAX_SPLITS:
        raise ValueError(f"paged_decode: num_splits must be in [1, {MAX_SPLITS}], got {num_splits}")
    group = heads // kv_heads
    out = torch.empty_like(q) if out is None else out
    if batch == 0:
        return out
    is_fp32 = q.dtype == torch.float32
    d_pad = _pow2(d, 16)
    block_n = block_n or (32 if is_fp32 or d_pad > 128 else 64)
    if num_splits > 1:
        part_out = torch.empty((batch, heads, num_splits, d), dtype=torch.float32, device=q.device)
        part_lse = torch.empty((batch, heads, num_splits), dtype=torch.float32, device=q.device)
    else:
        part_out, part_lse = out, ctx_lens  # unused
    _paged_decode_kernel[(batch, kv_heads, num_splits)](
        q, keys, values, tables, rows if rows is not None else ctx_lens, ctx_lens, out, part_out, part_lse,
        scale, window, num_splits,
        q.stride(0), q.stride(1),
        keys.stride(0), keys.stride(1), keys.stride(2),
        values.stride(0), values.stride(1), values.stride(2),
        tables.stride(0), tables.stride(1),
        out.stride(0), out.stride(1),
        part_out.stride(0), part_out.stride(1), part_out.stride(2) if num_splits > 1 else 0,
        part_lse.stride(0), part_lse.stride(1) if num_splits > 1 else 0,
        GROUP=group, G_PAD=_pow2(group, 16), HEAD_DIM=d, D_PAD=d_pad, BLOCK_SIZE=block_size, BLOCK_N=block_n,
        SPLIT=num_splits > 1, HAS_ROWS=rows is not None, IS_FP32=is_fp32,
        num_warps=4, num_stages=2,
    )
    if num_splits > 1:
        _merge_splits_kernel[(batch, heads)](
            part_out, part_lse, out, num_splits,
            part_out.stride(0), part_out.stride(1), part_out.stride(2), part_lse.stride(0), part_lse.stride(1),
            out.stride(0), out.stride(1),
            HEAD_DIM=d, D_PAD=d_pad, S_PAD=_pow2(MAX_SPLITS),  # one compiled variant for any split count
        )
    return out


def write_kv(
    k: torch.Tensor, v: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, tables: torch.Tensor,
    rows: torch.Tensor, positions: torch.Tensor,
) -> None:
    """Store k/v [T, kv_heads, D] of token t at position positions[t] of table row rows[t]
    (positions < 0 are padding: nothing is written)."""
    t, kv_heads, d = k.shape
    if t == 0:
        return
    if k.stride(-1) != 1 or v.stride(-1) != 1:
        raise ValueError("write_kv: k and v need a contiguous last dimension")
    _write_kv_kernel[(t,)](
        k, v, keys, values, tables, rows, positions,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        keys.stride(0), keys.stride(1), keys.stride(2), values.stride(0), values.stride(1), values.stride(2),
        tables.stride(0), tables.stride(1),
        KV_HEADS=kv_heads, H_PAD=_pow2(kv_heads), HEAD_DIM=d, D_PAD=_pow2(d, 16), BLOCK_SIZE=keys.shape[1],
        num_warps=1,
    )
