"""gpu_ext/cpu_decode.py's `decode_layers`: a decode step's layers in one C++ call, held to the
per-layer path it replaces (the same ops, so the same bits) on a generated fp32 model: every
step's logits equal, greedy tokens equal, for 1 and 3 sequences (qkv bias and a sliding window
too), and bad inputs raise instead of writing outside the cache."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from gpu_ext.linear import small_ops
from services.gpu_worker.engine.checkpoint_gen import make_model
from services.gpu_worker.engine.engine import EngineConfig, LLMEngine
from services.gpu_worker.engine.sampling_params import SamplingParams

OPS = small_ops("cpu", torch.float32)
pytestmark = pytest.mark.skipif(OPS is None or not hasattr(OPS, "decode_layers"),
                                reason="gpu_ext's CPU kernels are not built here (no compiler, or TIDAL_CPU_KERNELS=0)")


def _run(model_dir: Path, prompts: list[list[int]], fused: bool) -> tuple[list[list[int]], list[torch.Tensor], int]:
    """Greedy tokens, every step's logits, and how many steps ran the one-call path (`fused`;
    else the one call is refused and the layers run one by one)."""
    eng = LLMEngine(EngineConfig(str(model_dir), pool_bytes=64 << 20, block_size=4, max_num_seqs=4))
    model = eng.runner.model
    logits: list[torch.Tensor] = []
    compute, layers_call = model.compute_logits, model.decode_layers
    calls = [0]

    def record(hidden: torch.Tensor) -> torch.Tensor:
        out = compute(hidden)
        logits.append(out.clone())
        return out

    def counted(*args: object) -> torch.Tensor | None:
        out = layers_call(*args) if fused else None
        calls[0] += out is not None
        return out

    model.compute_logits, model.decode_layers = record, counted
    results = eng.generate(prompts, SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))
    return [r.token_ids for r in results], logits, calls[0]


@pytest.mark.parametrize("arch,window,n", [("llama", None, 1), ("llama", None, 3), ("qwen2", 6, 3)])
def test_one_call_decode_equals_the_per_layer_path(tmp_path: Path, arch: str, window: int | None, n: int) -> None:
    model_dir = make_model(tmp_path, arch=arch, layers=3, hidden=64, heads=4, kv_heads=2, intermediate=96,
                           vocab=300, seed=5, sliding_window=window)
    prompts = [[5 + i, 17, 33 + 2 * i, 8, 90][: 3 + i] for i in range(n)]
    fast_tokens, fast_logits, fast_calls = _run(model_dir, prompts, fused=True)
    slow_tokens, slow_logits, _ = _run(model_dir, prompts, fused=False)
    assert fast_calls >= 19  # every decode step ran the one call
    assert fast_tokens == slow_tokens
    assert len(fast_logits) == len(slow_logits)
    assert all(torch.equal(a, b) for a, b in zip(fast_logits, slow_logits))


def test_bad_inputs_raise() -> None:
    L, T, KVH, D, H, hid = 1, 1, 1, 8, 2, 16
    w = dict(input_norm=[torch.ones(hid)], wqkv=[torch.randn((H + 2 * KVH) * D, hid)], bqkv=[],
             wo=[torch.randn(hid, H * D)], post_norm=[torch.ones(hid)], w13=[torch.randn(64, hid)],
             w2=[torch.randn(hid, 32)])
    cos, sin = torch.ones(T, 1, D), torch.zeros(T, 1, D)
    kc, vc = torch.zeros(4, 2, KVH, D), torch.zeros(4, 2, KVH, D)
    tables, ctx = torch.zeros(L, T, 1, dtype=torch.long), torch.ones(T, dtype=torch.long)

    def call(slots: torch.Tensor, **over: list[torch.Tensor]) -> torch.Tensor:
        a = w | over
        return OPS.decode_layers(torch.randn(T, hid), a["input_norm"], a["wqkv"], a["bqkv"], a["wo"], a["post_norm"],
                                 a["w13"], a["w2"], 1e-5, cos, sin, H, KVH, D, kc, vc, slots, tables, ctx, D**-0.5, 0)

    assert call(torch.zeros(L, T, dtype=torch.long)).shape == (T, hid)
    assert kc[0, 0].abs().sum() > 0  # the new token's K went to slot 0
    with pytest.raises(RuntimeError, match="outside the cache"):
        call(torch.full((L, T), 8, dtype=torch.long))
    with pytest.raises(RuntimeError, match="one tensor per layer"):
        call(torch.zeros(L, T, dtype=torch.long), wo=[])
    with pytest.raises(RuntimeError, match="slots must be"):
        call(torch.zeros(L, T + 1, dtype=torch.long))
