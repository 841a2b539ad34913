"""gpu_ext's fused Triton stages (RMSNorm with the residual add, rotary embedding of q and k,
SiLU * up) under Triton's interpreter on CPU against the model's torch ops they replace on
CUDA: equal up to the fp32 mean's order (fp32), and rounded where torch rounds (fp16)."""
from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("triton", reason="triton is in the dev extras")
if os.environ.get("TRITON_INTERPRET") != "1":  # tests/conftest.py sets it where there is no NVIDIA driver
    pytest.skip("Triton's interpreter is off (a CUDA machine: tests/gpu runs these kernels compiled)",
                allow_module_level=True)
from gpu_ext.triton_fused import rms_norm, rope_qk, silu_mul

from services.gpu_worker.engine.models.llama import apply_rope, rms_norm as torch_rms_norm

DTYPES = [torch.float32, torch.float16]


def tol(dtype: torch.dtype) -> dict:
    return dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("with_residual", [False, True])
def test_rms_norm_matches_the_model_op(dtype, with_residual):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(5, 96, generator=g).to(dtype)
    res = torch.randn(5, 96, generator=g).to(dtype)
    w = (1 + 0.1 * torch.randn(96, generator=g)).to(dtype)
    out, h = rms_norm(x, w, 1e-5, residual=res if with_residual else None)
    expected_h = res + x if with_residual else x
    assert torch.equal(h, expected_h)  # the residual add rounds exactly as torch's
    torch.testing.assert_close(out, torch_rms_norm(expected_h, w, 1e-5), **tol(dtype))


@pytest.mark.parametrize("dtype", DTYPES)
def test_rope_of_q_and_k_out_of_the_qkv_projection(dtype):
    g = torch.Generator().manual_seed(2)
    heads, kv_heads, d, max_pos = 6, 2, 16, 64
    qkv = torch.randn(4, (heads + 2 * kv_heads) * d, generator=g).to(dtype)
    inv = 1.0 / (10000 ** (torch.arange(0, d, 2).float() / d))
    freqs = torch.arange(max_pos).float()[:, None] * inv[None, :]
    cos, sin = freqs.cos().to(dtype), freqs.sin().to(dtype)
    positions = torch.tensor([0, 7, 63, -1])  # -1: a graph's padding row reads the last row, as torch does
    q, k = rope_qk(qkv, cos, sin, positions, heads, kv_heads, d)
    c, s = cos[positions].unsqueeze(1), sin[positions].unsqueeze(1)
    want_q = apply_rope(qkv[:, : heads * d].reshape(4, heads, d), c, s)
    want_k = apply_rope(qkv[:, heads * d : (heads + kv_heads) * d].reshape(4, kv_heads, d), c, s)
    torch.testing.assert_close(q, want_q, **tol(dtype))
    torch.testing.assert_close(k, want_k, **tol(dtype))


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_mul_matches_the_model_op(dtype):
    g = torch.Generator().manual_seed(3)
    gate_up = torch.randn(3, 2 * 1500, generator=g).to(dtype)  # more than one block of 1024
    gate, up = gate_up.split(1500, dim=-1)
    torch.testing.assert_close(silu_mul(gate_up, 1500), F.silu(gate) * up, **tol(dtype))
