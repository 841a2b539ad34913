"""Automatic prefix caching on CUDA: tests/engine/test_prefix_caching.py's token-equality checks with
the engines on one CUDA device (cache on against cache off there): a shared system prompt across
concurrent requests, and preemption under a tiny KV pool where cached-free blocks are evicted and
hit again (decode runs through the CUDA path, graphs included, on tables with shared blocks).

`TIDAL_GPU_TESTS_DEVICE=cpu` runs the same checks on CPU (a dry run of the tests themselves).
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch

from services.gpu_worker.engine.checkpoint_gen import make_model

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "engine"))  # as pytest imports it: no package
import test_prefix_caching as pc  # noqa: E402

DEVICE = os.environ.get("TIDAL_GPU_TESTS_DEVICE", "cuda:0")
pytestmark = [
    pytest.mark.skipif(DEVICE.startswith("cuda") and not torch.cuda.is_available(), reason="needs CUDA"),
    pytest.mark.timeout(300),
]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return make_model(tmp_path_factory.mktemp("cuda-prefix"), arch="llama", layers=2, hidden=64, heads=4, kv_heads=2,
                      vocab=512, seed=3)


def test_shared_system_prompt_on_device(model_dir: Path) -> None:
    prompts = [pc.SYSTEM + q for q in pc.QUESTIONS]
    expected = pc.tokens(pc.engine(model_dir, cache=False, device=DEVICE), prompts)
    on = pc.engine(model_dir, device=DEVICE, max_num_batched_tokens=16, max_num_seqs=4)
    assert pc.tokens(on, prompts) == expected
    assert pc.tokens(on, prompts) == expected
    assert pc.hits(on) > 0 and on.blocks.num_used_blocks == 0


def test_preemption_with_the_cache_on_device(model_dir: Path) -> None:
    prompts = [pc.SYSTEM + q for q in pc.QUESTIONS] * 2
    kw: dict[str, object] = {"max_model_len": 128, "max_num_seqs": 4, "max_num_batched_tokens": 16, "device": DEVICE}
    expected = pc.tokens(pc.engine(model_dir, cache=False, **kw), prompts)
    small = pc.engine(model_dir, kv_blocks=60, **kw)
    assert pc.tokens(small, prompts) == expected
    assert small.scheduler.num_preemptions > 0 and pc.hits(small) > 0
