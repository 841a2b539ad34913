"""Our runner (paged KV, batched steps) vs transformers' own Llama/Qwen2/Mistral on the same
generated checkpoint, fp32: prefill + 64 decode steps over a batch of mixed lengths."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from services.gpu_worker.engine.block_manager import BlockManager
from services.gpu_worker.engine.checkpoint_gen import make_model
from services.gpu_worker.engine.greedy_driver import GreedyDriver
from services.gpu_worker.engine.memory_pool import MemoryPool
from services.gpu_worker.engine.model_runner import ModelRunner

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tests/engine/conftest.py


PROMPT_LENS = [1, 5, 16, 17, 40]  # includes a one-token prompt and block boundaries
DECODE_STEPS = 64

VARIANTS = {
    "llama": dict(arch="llama", layers=3, hidden=64, heads=4, kv_heads=2),
    "llama-mha-tied": dict(arch="llama", layers=2, hidden=64, heads=4, kv_heads=4, tie_embeddings=True),
    "llama3-rope-gqa1": dict(
        arch="llama", layers=2, hidden=64, heads=4, kv_heads=1, max_position=256, rope_theta=500000.0,
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                      "original_max_position_embeddings": 32},
    ),
    "qwen2": dict(arch="qwen2", layers=3, hidden=64, heads=4, kv_heads=2),
    "mistral-window": dict(arch="mistral", layers=2, hidden=64, heads=4, kv_heads=2, sliding_window=24),
}


def prompts(vocab: int, seed: int = 0) -> dict[str, list[int]]:
    g = torch.Generator().manual_seed(seed)
    return {f"seq{i}": torch.randint(0, vocab, (n,), generator=g).tolist() for i, n in enumerate(PROMPT_LENS)}


_RUNS: dict[tuple, dict] = {}


def run_ours(model_dir: Path, block_size: int = 16, chunk: int | None = None):
    """Greedy outputs and logits of our runner (memoised: several tests compare one run)."""
    key = (model_dir, block_size, chunk)
    if key not in _RUNS:
        _RUNS[key] = _run(model_dir, block_size, chunk)
    return _RUNS[key]


def _run(model_dir: Path, block_size: int, chunk: int | None):
    pool = MemoryPool(32 << 20)
    runner = ModelRunner(model_dir, pool, block_size=block_size)
    blocks = BlockManager(pool, block_size=block_size, block_bytes=runner.kv_block_bytes, layers=runner.layers)
    driver = GreedyDriver([(runner, blocks)])
    for seq_id, p in prompts(runner.cfg.vocab_size).items():
        driver.add(seq_id, p)
    driver.generate(DECODE_STEPS + 1, chunk=chunk)
    return driver.seqs


def oracle_logits(model, tokens: list[int]) -> torch.Tensor:
    """Teacher-forced: row t = logits after tokens[: t + 1]."""
    with torch.no_grad():
        return model(torch.tensor([tokens])).logits[0].float()


@pytest.fixture(scope="module", params=sorted(VARIANTS))
def variant(request, tmp_path_factory) -> tuple[str, Path]:
    name = request.param
    return name, make_model(tmp_path_factory.mktemp(name), seed=3, **VARIANTS[name])


def test_logits_and_greedy_tokens_match_transformers(variant):
    name, model_dir = variant
    seqs = run_ours(model_dir, block_size=4 if name == "llama" else 16)  # small blocks: many per sequence
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    assert type(hf).__name__ == {"qwen2": "Qwen2ForCausalLM", "mistral": "MistralForCausalLM"}.get(
        VARIANTS[name]["arch"], "LlamaForCausalLM")
    worst = 0.0
    for seq_id, seq in seqs.items():
        ref = oracle_logits(hf, seq.tokens[:-1])[seq.prompt_len - 1 :]
        ours = torch.stack(seq.logits)
        assert ours.shape == ref.shape == (DECODE_STEPS + 1, hf.config.vocab_size)
        worst = max(worst, (ours - ref).abs().max().item())
        assert torch.equal(ref.argmax(-1), torch.tensor(seq.output)), f"{name}/{seq_id}: greedy tokens differ"
    assert worst <= 1e-4, f"{name}: max |logit diff| {worst:.2e}"
    outputs = {tuple(s.output[:8]) for s in seqs.values()}
    assert len(outputs) == len(seqs), "generated model is degenerate: prompts give the same output"


@pytest.mark.parametrize("chunk", [3, 16])
def test_chunked_prefill_matches_one_shot(variant, chunk):
    name, model_dir = variant
    one_shot = run_ours(model_dir)
    chunked = run_ours(model_dir, chunk=chunk)
    for seq_id in one_shot:
        assert chunked[seq_id].output == one_shot[seq_id].output, f"{name}/{seq_id}"
        diff = (torch.stack(chunked[seq_id].logits) - torch.stack(one_shot[seq_id].logits)).abs().max().item()
        assert diff <= 1e-5
