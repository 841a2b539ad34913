"""CUDA graphs for decode (engine/cuda_graphs.py) on the device: an engine whose decode steps
replay graphs produces the tokens and logprobs of the same engine stepping eagerly (fp32 and
bf16 models), captures one graph per batch bucket and reuses it as the batch shrinks and new
requests arrive, runs a decode step with no host synchronisation (torch's sync debug mode
set to error), and drops its graphs when weights move (drop/restore layers)."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from services.gpu_worker.engine.checkpoint_gen import make_model
from services.gpu_worker.engine.engine import EngineConfig, LLMEngine
from services.gpu_worker.engine.sampling_params import SamplingParams

pytestmark = [pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"), pytest.mark.timeout(300)]
DEVICE = "cuda:0"


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("graph-models")
    return {
        "fp32": make_model(root / "fp32", arch="llama", layers=3, hidden=256, heads=8, kv_heads=2, seed=2),
        "bf16": make_model(root / "bf16", arch="qwen2", layers=2, hidden=256, heads=4, kv_heads=2, seed=3,
                           dtype="bfloat16"),
    }


def engine(model_dir: Path, graphs: bool, **kw) -> LLMEngine:
    e = LLMEngine(EngineConfig(str(model_dir), pool_bytes=256 << 20, block_size=16, max_num_seqs=16,
                               max_num_batched_tokens=512, device=DEVICE, **kw))
    e.runner.use_graphs = graphs
    return e


def prompts(n: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 1000, (int(x),), generator=g).tolist() for x in torch.randint(1, 70, (n,), generator=g)]


def run(e: LLMEngine) -> list:
    lengths = [5, 40, 17, 33, 9, 24, 12, 3, 30, 21]  # staggered finishes: buckets 16, 8, 4, 2, 1
    first = e.generate(prompts(10, 1), [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, logprobs=0)
                                        for n in lengths])
    later = e.generate(prompts(3, 2), SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, logprobs=0))
    return first + later


@pytest.mark.parametrize("kind", ["fp32", "bf16"])
def test_graph_replays_equal_eager_steps(models, kind):
    torch.backends.cuda.matmul.allow_tf32 = False
    eager = run(engine(models[kind], graphs=False))
    graphed_engine = engine(models[kind], graphs=True)
    graphed = run(graphed_engine)
    graphs = graphed_engine.runner.graphs
    assert graphs is not None and graphs.steps >= 30
    assert graphs.captures == len({b for b in graphs.buckets if b <= 16 and graphs.graph_for(b) is not None})
    assert graphs.captures <= 5  # once per bucket, not per step
    # bf16: the graph's split-K differs from the eager step's (fixed per bucket), so sums round
    # differently; logprobs near -5 have a bf16 step of 0.03
    tol = 1e-3 if kind == "fp32" else 0.15
    for i, (a, b) in enumerate(zip(graphed, eager)):
        if kind == "fp32":
            assert a.token_ids == b.token_ids, f"seq {i}: tokens differ"
        n = next((j for j, (x, y) in enumerate(zip(a.token_ids, b.token_ids)) if x != y), len(a.token_ids))
        assert max(abs(x - y) for x, y in zip(a.logprobs[:n], b.logprobs[:n])) <= tol, f"seq {i}"
        if n < len(a.token_ids):  # bf16 (seen on an H200): where they part, both choices were a near-tie
            assert abs(a.logprobs[n] - b.logprobs[n]) <= tol, f"seq {i}: token {n} differs beyond a near-tie"


def test_a_graph_decode_step_does_not_synchronize(models):
    e = engine(models["bf16"], graphs=True)
    for i, p in enumerate(prompts(6, 4)):
        e.add_request(f"r{i}", p, SamplingParams(temperature=0, max_tokens=50, ignore_eos=True))
    for _ in range(4):  # prefill, then decode steps that capture the bucket's graph
        e.step()
    out = e.scheduler.schedule()
    assert all(len(c.token_ids) == 1 for c in out.chunks)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        result = e.runner.execute(out)  # host metadata, uploads, replay: nothing may wait on the device
        with pytest.raises(RuntimeError, match="synchroniz"):
            result.logits.argmax(-1).tolist()  # the token fetch is the step's one sync (the mode is live)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert e.runner.graphs is not None and e.runner.graphs.steps >= 2


def test_weights_moving_drops_the_graphs(models):
    e = engine(models["fp32"], graphs=True)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    before = e.generate(prompts(2, 5), params)
    assert e.runner.graphs is not None
    e.drop_layers(1, 2)
    assert e.runner.graphs is None
    e.restore_layers(1, 2)
    after = e.generate(prompts(2, 5), params)
    assert [r.token_ids for r in after] == [r.token_ids for r in before]
    assert e.runner.graphs is not None and e.runner.graphs.captures >= 1
