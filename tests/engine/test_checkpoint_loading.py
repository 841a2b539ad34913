"""Loading checkpoints: sharded = single file, dtypes, rope scaling parsed as transformers
does, and refusals that name the problem (architecture, file, tensor shape)."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from services.gpu_worker.engine.block_manager import BlockManager
from services.gpu_worker.engine.checkpoint_gen import make_lora, make_model
from services.gpu_worker.engine.greedy_driver import GreedyDriver
from services.gpu_worker.engine.lora import load_adapter
from services.gpu_worker.engine.memory_pool import MemoryPool
from services.gpu_worker.engine.model_config import CheckpointError, load_model_config
from services.gpu_worker.engine.model_runner import ModelRunner

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tests/engine/conftest.py


SMALL = dict(layers=2, hidden=64, heads=4, kv_heads=2, vocab=512, seed=1)


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> Path:
    return make_model(tmp_path_factory.mktemp("base") / "m", **SMALL)


@pytest.fixture
def copy(base, tmp_path) -> Path:
    return Path(shutil.copytree(base, tmp_path / "copy"))


def greedy(model_dir: Path, dtype: str | None = None, n: int = 8):
    pool = MemoryPool(16 << 20)
    runner = ModelRunner(model_dir, pool, dtype=dtype)
    driver = GreedyDriver([(runner, BlockManager(pool, block_size=16, block_bytes=runner.kv_block_bytes,
                                                 layers=runner.layers))])
    driver.add("a", [5, 6, 7, 8, 9])
    driver.add("b", list(range(100, 130)))
    driver.generate(n)
    return driver.seqs


def edit_config(model_dir: Path, **changes) -> None:
    path = model_dir / "config.json"
    cfg = json.loads(path.read_text())
    cfg.update(changes)
    path.write_text(json.dumps(cfg))


def test_sharded_checkpoint_loads_the_same_weights(base, tmp_path):
    sharded = make_model(tmp_path / "sharded", shard_size=60_000, **SMALL)
    assert len(list(sharded.glob("model-*-of-*.safetensors"))) > 2 and (sharded / "model.safetensors.index.json").exists()
    one, many = greedy(base), greedy(sharded)
    for s in one:
        assert torch.equal(torch.stack(one[s].logits), torch.stack(many[s].logits))


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_half_precision_runs_close_to_fp32(base, dtype):
    ref, half = greedy(base), greedy(base, dtype=dtype)
    for s in ref:
        first = half[s].logits[0]
        assert torch.isfinite(first).all()
        assert (first - ref[s].logits[0]).abs().max() < 0.25  # rounding only, not a different model


def test_config_parses_llama3_rope_like_transformers(copy):
    from transformers import AutoConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64}
    edit_config(copy, rope_scaling=scaling, rope_theta=500000.0, max_position_embeddings=1024)
    ours = load_model_config(copy)
    hf_cfg = AutoConfig.from_pretrained(copy)
    hf_inv, _ = ROPE_INIT_FUNCTIONS["llama3"](hf_cfg, "cpu")
    assert ours.rope.kind == "llama3" and ours.rope.theta == 500000.0
    assert torch.allclose(ours.rope.inv_freq(ours.head_dim), hf_inv, rtol=0, atol=0)
    assert ours.eos_token_ids and ours.generation.eos_token_ids and ours.bos_token_id is not None


def test_unknown_architecture_is_named(copy):
    edit_config(copy, architectures=["GPT2LMHeadModel"])
    with pytest.raises(CheckpointError, match=r"unknown architecture \['GPT2LMHeadModel'\]"):
        ModelRunner(copy, MemoryPool(16 << 20))


def test_unsupported_rope_type_is_named(copy):
    edit_config(copy, rope_scaling={"rope_type": "yarn", "factor": 4.0})
    with pytest.raises(CheckpointError, match="unsupported rope_scaling type 'yarn'"):
        load_model_config(copy)


@pytest.mark.parametrize("missing", ["config.json", "model.safetensors"])
def test_missing_file_is_named(copy, missing):
    (copy / missing).unlink()
    with pytest.raises(CheckpointError, match=f"missing file: .*{missing.replace('.', '.')}|no \\*.safetensors"):
        ModelRunner(copy, MemoryPool(16 << 20))


def test_missing_shard_listed_in_index_is_named(tmp_path):
    sharded = make_model(tmp_path / "sharded", shard_size=60_000, **SMALL)
    victim = sorted(sharded.glob("model-*-of-*.safetensors"))[1]
    victim.unlink()
    with pytest.raises(CheckpointError, match=f"missing file: .*{victim.name}"):
        ModelRunner(sharded, MemoryPool(16 << 20))


def test_missing_tensor_is_named(base, tmp_path):
    from safetensors.torch import load_file, save_file

    model_dir = Path(shutil.copytree(base, tmp_path / "m"))
    tensors = load_file(str(model_dir / "model.safetensors"))
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, str(model_dir / "model.safetensors"))
    with pytest.raises(CheckpointError, match="'model.layers.1.mlp.up_proj.weight' is missing"):
        ModelRunner(model_dir, MemoryPool(16 << 20))
    ModelRunner(model_dir, MemoryPool(16 << 20), layers=range(0, 1))  # only layer 0 is read


def test_shape_mismatch_is_named(copy):
    edit_config(copy, intermediate_size=128)  # the weights were made with 256
    with pytest.raises(CheckpointError, match=r"shape mismatch for 'model.layers.0.mlp.gate_proj.weight': "
                                              r"checkpoint has \(256, 64\), config.json implies \(128, 64\)"):
        ModelRunner(copy, MemoryPool(16 << 20))


def test_adapter_refusals_are_named(base, tmp_path):
    cfg = load_model_config(base)
    good = make_lora(tmp_path / "ok", base, rank=4)
    assert load_adapter(good, "ok", cfg, range(cfg.num_layers)).rank == 4
    other = make_model(tmp_path / "wide", **(SMALL | {"hidden": 128}))
    wide = make_lora(tmp_path / "wide-lora", other, rank=4)
    with pytest.raises(CheckpointError, match=r"shape mismatch at layer 0 [qkv]_proj: A \(4, 128\)"):
        load_adapter(wide, "wide", cfg, range(cfg.num_layers))
    raw = json.loads((good / "adapter_config.json").read_text())
    (good / "adapter_config.json").write_text(json.dumps(raw | {"use_dora": True}))
    with pytest.raises(CheckpointError, match="use_dora is not supported"):
        load_adapter(good, "ok", cfg, range(cfg.num_layers))
    (good / "adapter_model.safetensors").unlink()
    with pytest.raises(CheckpointError, match="missing file: .*adapter_model.safetensors"):
        load_adapter(good, "ok", cfg, range(cfg.num_layers))
