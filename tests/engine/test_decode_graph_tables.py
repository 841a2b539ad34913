"""The decode path of the CUDA graphs (engine/cuda_graphs.py) on CPU: the same static buffers
(token ids, positions with padding rows, a row map, block tables written incrementally) and
the same Triton kernels, run under Triton's interpreter without a capture, and the model's
fused Triton stages (RMSNorm, rope, SiLU * up) as on CUDA. An engine whose steps take that
path produces the tokens and logprobs of the plain engine while
sequences cross block boundaries, finish at different steps (buckets shrink, rows are freed
and reused by later requests) and, for Mistral, attend within a sliding window."""
from __future__ import annotations

import os

import pytest
import torch

pytest.importorskip("triton", reason="triton is in the dev extras")
if os.environ.get("TRITON_INTERPRET") != "1":  # tests/conftest.py sets it where there is no NVIDIA driver
    pytest.skip("Triton's interpreter is off (a CUDA machine: tests/gpu runs these kernels compiled)",
                allow_module_level=True)

from services.gpu_worker.engine.checkpoint_gen import make_model
from services.gpu_worker.engine.engine import EngineConfig, LLMEngine
from services.gpu_worker.engine.sampling_params import SamplingParams

pytestmark = pytest.mark.usefixtures("one_torch_thread")

VARIANTS = {
    "llama": dict(arch="llama", layers=2, hidden=64, heads=4, kv_heads=2),
    "mistral-window": dict(arch="mistral", layers=2, hidden=64, heads=4, kv_heads=2, sliding_window=9),
}


def engine(model_dir, graphs: bool) -> LLMEngine:
    eng = LLMEngine(EngineConfig(str(model_dir), pool_bytes=64 << 20, block_size=4, max_num_seqs=8,
                                 max_num_batched_tokens=256))
    if graphs:  # on CPU: the graphs' buffers and kernels without a capture, the fused stages of CUDA
        from gpu_ext import triton_fused

        eng.runner.use_graphs = True
        eng.runner.model.fused = triton_fused
    return eng


def run(eng: LLMEngine, prompts: list[list[int]], lengths: list[int]):
    first = eng.generate(prompts[:3], [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, logprobs=0)
                                       for n in lengths[:3]])
    # later requests take the rows the finished ones freed
    later = eng.generate(prompts[3:], [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, logprobs=0)
                                       for n in lengths[3:]])
    return [(r.token_ids, r.logprobs) for r in first + later]


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_decode_through_static_tables_equals_the_plain_engine(tmp_path, variant):
    model_dir = make_model(tmp_path / variant, seed=4, vocab=512, max_position=128, **VARIANTS[variant])
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 512, (n,), generator=g).tolist() for n in (1, 6, 17, 3, 9)]
    lengths = [9, 3, 6, 5, 7]
    plain = run(engine(model_dir, graphs=False), prompts, lengths)
    graphed_engine = engine(model_dir, graphs=True)
    graphed = run(graphed_engine, prompts, lengths)
    graphs = graphed_engine.runner.graphs
    assert graphs is not None and graphs.steps >= sum(lengths[:3]) // 3  # the decode steps took the path
    for (tokens, logprobs), (want_tokens, want_logprobs) in zip(graphed, plain):
        assert tokens == want_tokens
        assert logprobs == pytest.approx(want_logprobs, abs=1e-4)
    # rows are given back at the next step without the sequence: only the last step's remain, none leaked
    assert len(graphs._rows) <= 2 and len(graphs._free) + len(graphs._rows) == graphs.num_rows
