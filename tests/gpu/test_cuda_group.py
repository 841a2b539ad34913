"""KunServe buddy-group execution on CUDA: tests/engine/test_buddy_group.py's checks with both
engines (and the unsplit reference) on one CUDA device, joined by the loopback channel.

Frames cross the real wire format (host bytes), so every tensor a member receives — hidden
states, logits, remote attention's q/k/v and output, exchanged KV — comes off the wire in host
memory and must be moved to the member's device. Tokens must equal the unsplit CUDA engine's,
greedy and seeded (the seeded sampler draws on the logits' device, so logits sampled on the host
would give other tokens); victims decoding through the drop keep decoding on remote attention
while their KV is exchanged, token-exact.

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
import test_buddy_group as bg  # noqa: E402

DEVICE = os.environ.get("TIDAL_GPU_TESTS_DEVICE", "cuda:0")
pytestmark = [
    pytest.mark.skipif(DEVICE.startswith("cuda") and not torch.cuda.is_available(), reason="needs CUDA"),
    pytest.mark.timeout(300),
]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("cuda-group")
    return make_model(root / "m", arch="qwen2", layers=bg.LAYERS, hidden=64, heads=4, kv_heads=2, seed=5)


def on_device(*members) -> None:
    want = torch.device(DEVICE).type
    for m in members:
        runner = m.engine.runner
        assert runner.device.type == want
        assert runner.kv_cache.blocks.device.type == want
        assert all(w.wqkv.device.type == want for w in runner.model.layers.values())


@pytest.mark.parametrize("seeded", [False, True], ids=["greedy", "seeded"])
@pytest.mark.parametrize("split", [1, 3])
def test_group_tokens_equal_unsplit_cuda_run(model_dir, seeded, split):
    a, b = bg.check_group_tokens_equal_unsplit_run(model_dir, seeded, split, device=DEVICE)
    on_device(a, b)


def test_each_micro_batch_costs_one_hop_per_stage_on_cuda(model_dir):
    bg.check_each_micro_batch_costs_one_hop_per_stage(model_dir, device=DEVICE)


@pytest.mark.parametrize("seeded", [False, True], ids=["greedy", "seeded"])
def test_requests_decoding_through_a_drop_are_token_exact_on_cuda(model_dir, seeded):
    """Remote attention (q/k/v off the wire, served on the owner's CUDA KV) and the KV exchange."""
    a, b = bg.check_requests_decoding_through_a_drop_are_token_exact(model_dir, seeded, device=DEVICE)
    on_device(a, b)
    assert a.executor.remote_calls + b.executor.remote_calls > 0
