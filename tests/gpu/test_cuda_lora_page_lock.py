"""Page-locked host copies of adapters on CUDA and the cold-start rule's link rates (issue 31; needs a GPU).

A CUDA engine page-locks every adapter's host copy — pinned (plain) or registered in place (the
shared file the CPU helpers map) — so its loads are DMAs timed as "page-locked"; the probe measures
both kinds before any load; with `lora_page_lock=False` copies stay pageable. Tokens equal PEFT's
path whichever copy loaded them (the warm run on the same engine). The CPU test of the selection
logic is tests/policy/test_lora_cold_choice.py::test_page_lock_only_on_a_cuda_engine_with_cuda.
"""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.fixture(scope="module")
def assets(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    from services.gpu_worker.engine.checkpoint_gen import make_lora, make_model

    root = tmp_path_factory.mktemp("page-lock")
    base = make_model(root / "base", layers=2, hidden=64, heads=4, kv_heads=2, seed=5)
    return base, make_lora(root / "a", base, rank=16, targets=["q", "k", "v"], seed=1)


def _engine(base: Path, assist: bool, lock: bool = True):  # type: ignore[no-untyped-def]
    from services.gpu_worker.engine.engine import EngineConfig, LLMEngine

    return LLMEngine(EngineConfig(str(base), device="cuda:0", pool_bytes=256 << 20, cpu_lora_assist=assist,
                                  cpu_lora_processes=1, lora_load_mode="auto", lora_page_lock=lock))


def _run(eng, rid: str, ids: list[int]) -> list[int]:  # type: ignore[no-untyped-def]
    from services.gpu_worker.engine.sampling_params import SamplingParams

    eng.add_request(rid, ids, SamplingParams(max_tokens=4, temperature=0), adapter="a")
    out: list[int] = []
    while eng.has_unfinished:
        out += [t for d in eng.step() for t in d.new_token_ids]
    return out


@pytest.mark.parametrize("assist", [False, True])  # plain host copy (pinned) / shared file (registered in place)
def test_host_copies_are_page_locked_and_loads_timed_as_such(assets, assist: bool) -> None:
    base, adapter = assets
    eng = _engine(base, assist)
    try:
        assert set(eng.cold.costs.links.rates) == {"pageable", "page-locked"}  # the probe measured both
        eng.add_lora("a", adapter)
        host = eng.runner.lora.host["a"]
        locks = eng.runner.lora.page_locks
        assert locks.enabled and locks.kind("a") == "page-locked"
        if not assist:
            assert all(a.is_pinned() and b.is_pinned() for a, b in host.weights.values())
        ids = list(range(5, 45))
        cold = _run(eng, "cold", ids)
        assert eng.cold.costs.trace["cold"].kind in ("cpu_assist", "async", "inline")
        assert _run(eng, "warm", ids) == cold
        eng.remove_lora("a")  # unregistered (after any copy in flight)
        assert not locks.locked("a")
    finally:
        eng.cold.close()


def test_page_lock_off_keeps_pageable_copies(assets) -> None:
    base, adapter = assets
    eng = _engine(base, False, lock=False)
    try:
        eng.add_lora("a", adapter)
        assert not eng.runner.lora.page_locks.enabled and eng.runner.lora.page_locks.kind("a") == "pageable"
        assert not any(a.is_pinned() for a, _ in eng.runner.lora.host["a"].weights.values())
    finally:
        eng.cold.close()
