"""Multi-LoRA batches vs PEFT's PeftModel on the same adapters (fp32): two adapters of
different ranks and base-model sequences in one batch, both batched paths."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
from peft import PeftModel
from transformers import AutoModelForCausalLM

from services.gpu_worker.engine.block_manager import BlockManager
from services.gpu_worker.engine.checkpoint_gen import make_lora, make_model
from services.gpu_worker.engine.greedy_driver import GreedyDriver
from services.gpu_worker.engine.memory_pool import MemoryPool
from services.gpu_worker.engine.model_runner import ModelRunner

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tests/engine/conftest.py


DECODE_STEPS = 64
# (prompt length, adapter): two adapters of different ranks and no adapter, interleaved
BATCH = [(9, "small"), (23, None), (4, "big"), (31, "small"), (1, "big"), (17, None)]


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def model_and_adapters(request, tmp_path_factory) -> tuple[Path, dict[str, Path]]:
    root = tmp_path_factory.mktemp(f"lora-{request.param}")
    base = make_model(root / "base", arch=request.param, layers=2, hidden=64, heads=4, kv_heads=2, seed=5)
    adapters = {
        "small": make_lora(root / "small", base, rank=4, targets=["q", "v"], seed=1),
        "big": make_lora(root / "big", base, rank=16, targets=["q", "k", "v", "o", "gate", "up", "down"], seed=2),
    }
    return base, adapters


_RUNS: dict[tuple, tuple] = {}


def run_ours(base: Path, adapters: dict[str, Path], mode: str):
    """(sequences, pool, runner) after the batch ran (memoised per model and mode)."""
    if (base, mode) not in _RUNS:
        _RUNS[(base, mode)] = _run(base, adapters, mode)
    return _RUNS[(base, mode)]


def _run(base: Path, adapters: dict[str, Path], mode: str):
    pool = MemoryPool(32 << 20)
    runner = ModelRunner(base, pool, lora_mode=mode)
    for name, path in adapters.items():
        runner.lora.register(name, path)
    blocks = BlockManager(pool, block_size=16, block_bytes=runner.kv_block_bytes, layers=runner.layers)
    driver = GreedyDriver([(runner, blocks)])
    g = torch.Generator().manual_seed(11)
    for i, (n, adapter) in enumerate(BATCH):
        driver.add(f"s{i}", torch.randint(0, runner.cfg.vocab_size, (n,), generator=g).tolist(), adapter)
    driver.generate(DECODE_STEPS + 1)
    return driver.seqs, pool, runner


@pytest.mark.parametrize("mode", ["padded", "segmented"])
def test_mixed_adapter_batch_matches_peft(model_and_adapters, mode):
    base, adapters = model_and_adapters
    seqs, pool, runner = run_ours(base, adapters, mode)
    assert pool.breakdown()["lora"] == sum(a.nbytes for a, _ in runner.lora.resident.values()) > 0
    oracles = {None: AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)}
    for name, path in adapters.items():
        plain = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
        oracles[name] = PeftModel.from_pretrained(plain, path).eval()
    worst, lora_effect = 0.0, 0.0
    for i, (_, adapter) in enumerate(BATCH):
        seq = seqs[f"s{i}"]
        with torch.no_grad():
            ref = oracles[adapter](torch.tensor([seq.tokens[:-1]])).logits[0, seq.prompt_len - 1 :]
            if adapter is not None:
                plain_ref = oracles[None](torch.tensor([seq.tokens[:-1]])).logits[0, seq.prompt_len - 1 :]
                lora_effect = max(lora_effect, (ref - plain_ref).abs().max().item())
        ours = torch.stack(seq.logits)
        worst = max(worst, (ours - ref).abs().max().item())
        assert torch.equal(ref.argmax(-1), torch.tensor(seq.output)), f"s{i} ({adapter}): greedy tokens differ"
    assert worst <= 1e-4, f"max |logit diff| vs PEFT {worst:.2e}"
    assert lora_effect > 0.1, "adapters barely change the logits: the comparison proves nothing"


def test_padded_and_segmented_paths_agree(model_and_adapters):
    base, adapters = model_and_adapters
    padded, _, _ = run_ours(base, adapters, "padded")
    segmented, _, _ = run_ours(base, adapters, "segmented")
    for seq_id in padded:
        assert padded[seq_id].output == segmented[seq_id].output
        diff = (torch.stack(padded[seq_id].logits) - torch.stack(segmented[seq_id].logits)).abs().max().item()
        assert diff <= 1e-4  # fp32 rounding of different op orders (bmm vs mm), over 65 steps


def test_lru_cache_evicts_and_releases_pool_charge(model_and_adapters):
    base, adapters = model_and_adapters
    pool = MemoryPool(8 << 20)
    runner = ModelRunner(base, pool, max_loras=1)
    for name, path in adapters.items():
        runner.lora.register(name, path)
    runner.lora.ensure_resident(["small"])
    small_bytes = pool.breakdown()["lora"]
    assert small_bytes == runner.lora.host["small"].nbytes
    runner.lora.ensure_resident(["big"])  # cache holds one: "small" is evicted, its charge released
    assert list(runner.lora.resident) == ["big"]
    assert pool.breakdown()["lora"] == runner.lora.host["big"].nbytes != small_bytes
    with pytest.raises(KeyError, match="unknown LoRA adapter 'nope'"):
        runner.lora.ensure_resident(["nope"])
