"""gpu_ext's CPU paged-decode kernel against SDPA over the same keys: a sequence whose blocks
form one contiguous chain (read as one stretch), the same keys in scattered blocks (read
block by block), and chains broken in the middle; head dims with a vector path (8, 32,
128) and without one (12); sliding windows; contexts that end mid-tile and mid-block."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from gpu_ext.cpu_attention import paged_decode_kernel

KERNEL = paged_decode_kernel()
pytestmark = pytest.mark.skipif(KERNEL is None, reason="the CPU kernel does not build here")

BS = 16
CTX = [1, 7, 8, 16, 17, 100, 333, 1024]


def expected(q: torch.Tensor, keys: list[torch.Tensor], values: list[torch.Tensor], window: int) -> torch.Tensor:
    outs = []
    for b, (k, v) in enumerate(zip(keys, values)):
        if window and k.shape[0] > window:
            k, v = k[-window:], v[-window:]
        out = F.scaled_dot_product_attention(q[b][:, None], k.transpose(0, 1), v.transpose(0, 1), enable_gqa=True)
        outs.append(out[:, 0])
    return torch.stack(outs)


def layout(nbs: list[int], kind: str, total: int, gen: torch.Generator) -> torch.Tensor:
    """Block tables [B, max nb] (padded with the first block) placing every sequence's blocks:
    contiguous chains, one random permutation, or chains broken every few blocks."""
    ids = torch.arange(total) if kind != "scattered" else torch.randperm(total, generator=gen)
    tables, start = [], 0
    for nb in nbs:
        t = ids[start : start + nb].tolist()
        if kind == "broken" and nb > 2:  # swap blocks so runs of 1-3 consecutive ids remain
            for i in range(1, nb - 1, 3):
                t[i], t[i + 1] = t[i + 1], t[i]
        tables.append(t + [t[0]] * (max(nbs) - nb))
        start += nb
    return torch.tensor(tables, dtype=torch.long)


@pytest.mark.parametrize("head_dim,heads,kv_heads", [(32, 8, 2), (8, 4, 4), (128, 4, 1), (12, 6, 2)])
@pytest.mark.parametrize("window", [0, 50])
def test_kernel_matches_sdpa_for_every_block_layout(head_dim, heads, kv_heads, window):
    gen = torch.Generator().manual_seed(head_dim + window)
    nbs = [-(-n // BS) for n in CTX]
    total = sum(nbs) + 3
    keys = [torch.randn(n, kv_heads, head_dim, generator=gen) for n in CTX]
    values = [torch.randn(n, kv_heads, head_dim, generator=gen) for n in CTX]
    q = torch.randn(len(CTX), heads, head_dim, generator=gen)
    want = expected(q, keys, values, window)
    ctx = torch.tensor(CTX, dtype=torch.long)
    for kind in ["contiguous", "scattered", "broken"]:
        tables = layout(nbs, kind, total, gen)
        kc = torch.full((total, BS, kv_heads, head_dim), float("nan"))  # unwritten slots must never be read
        vc = torch.full_like(kc, float("nan"))
        for b, n in enumerate(CTX):
            for t in range(n):
                kc[tables[b, t // BS], t % BS] = keys[b][t]
                vc[tables[b, t // BS], t % BS] = values[b][t]
        got = KERNEL(q, kc, vc, tables, ctx, head_dim**-0.5, window)
        assert (got - want).abs().max() < 1e-5, kind


def test_one_stretch_and_block_by_block_reads_agree():
    """The same keys in one contiguous chain (read as one stretch) and in permuted blocks
    (read block by block) give the same output to float rounding."""
    gen = torch.Generator().manual_seed(3)
    n, kvh, d, h = 300, 2, 32, 8
    nb = -(-n // BS)
    k, v = torch.randn(nb, BS, kvh, d, generator=gen), torch.randn(nb, BS, kvh, d, generator=gen)
    perm = torch.randperm(nb, generator=gen)
    kc, vc = torch.empty_like(k), torch.empty_like(v)
    kc[perm], vc[perm] = k, v
    q = torch.randn(1, h, d, generator=gen)
    ctx = torch.tensor([n])
    a = KERNEL(q, k, v, torch.arange(nb)[None], ctx, d**-0.5, 0)
    b = KERNEL(q, kc, vc, perm[None], ctx, d**-0.5, 0)
    assert (a - b).abs().max() < 1e-6
    assert torch.isfinite(a).all()


@pytest.mark.parametrize("batch", [1, 3])
@pytest.mark.parametrize("head_dim,heads,kv_heads", [(64, 9, 3), (12, 6, 2)])
def test_thread_counts_agree_bitwise(batch, head_dim, heads, kv_heads):
    """Fewer sequences than threads split a sequence by kv head (single-stream decode), more split
    by sequence: every thread count gives the same bits, and SDPA's answer."""
    gen = torch.Generator().manual_seed(batch + head_dim)
    lens = [150, 17, 64][:batch]
    nbs = [-(-n // BS) for n in lens]
    total = sum(nbs)
    kc = torch.randn(total, BS, kv_heads, head_dim, generator=gen)
    vc = torch.randn(total, BS, kv_heads, head_dim, generator=gen)
    tables = layout(nbs, "contiguous", total, gen)
    q = torch.randn(batch, heads, head_dim, generator=gen)
    ctx = torch.tensor(lens, dtype=torch.long)
    keys = [kc[tables[b, : nbs[b]]].flatten(0, 1)[:n] for b, n in enumerate(lens)]
    values = [vc[tables[b, : nbs[b]]].flatten(0, 1)[:n] for b, n in enumerate(lens)]
    before = torch.get_num_threads()
    outs = []
    try:
        for t in (1, 2, 4):
            torch.set_num_threads(t)
            outs.append(KERNEL(q, kc, vc, tables, ctx, head_dim**-0.5, 0))
    finally:
        torch.set_num_threads(before)
    assert all(torch.equal(o, outs[0]) for o in outs[1:])
    assert (outs[0] - expected(q, keys, values, 0)).abs().max() < 1e-5
