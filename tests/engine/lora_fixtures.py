"""What the CPU-LoRA cold-start tests share (test_cpu_lora_auto.py, test_cpu_lora_cold_start.py,
test_cpu_lora_takeover.py): a small base model, seeded prompts, greedy sampling, and a gate that
holds an adapter's load until the test opens it."""
from __future__ import annotations

import threading
from pathlib import Path

import pytest
import torch

from services.gpu_worker.engine.checkpoint_gen import make_model
from services.gpu_worker.engine.sampling_params import SamplingParams

GREEDY = SamplingParams(max_tokens=4, temperature=0)


def base_assets(name: str):
    """A module-scoped fixture: (a 3-layer, 64-wide base model, the directory for its adapters)."""

    @pytest.fixture(scope="module")
    def assets(tmp_path_factory) -> tuple[Path, Path]:
        root = tmp_path_factory.mktemp(name)
        return make_model(root / "base", layers=3, hidden=64, heads=4, kv_heads=2, seed=7), root

    return assets


def prompt(n: int, seed: int) -> list[int]:
    return torch.randint(1, 1000, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def hold_loads(engine) -> threading.Event:
    """The engine's adapter loads land only once the returned event is set (it stands in for the pacing sleep)."""
    gate = threading.Event()
    engine.cold.loads._sleep = lambda _s: gate.wait(60)  # noqa: SLF001 - the load lands when the test says
    return gate


def finish(engine) -> dict[str, list[int]]:
    """Step until every request is done; request id -> its tokens."""
    out: dict[str, list[int]] = {}
    while engine.has_unfinished:
        for d in engine.step():
            out.setdefault(d.request_id, []).extend(d.new_token_ids)
    return out
