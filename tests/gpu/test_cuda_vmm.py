"""The KV region on CUDA through the driver's virtual memory management (needs a GPU).

Reserving the region costs address space only; chunks are mapped as blocks are handed out
and unmapped when they are retired, at the same addresses; two instances sharing one pool
on one device hold together what the pool gives KV, not twice the pool (which the eager
fallback would); freed weights become KV blocks in place while requests decode token-exact.
"""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

GIB = 1 << 30


def free_bytes() -> int:
    torch.cuda.synchronize()
    return torch.cuda.mem_get_info()[0]


def test_region_maps_chunks_on_demand_at_fixed_addresses() -> None:
    from gpu_ext.cuda_vmm import CudaVmmRegion
    from gpu_ext.memory import reserve_region

    before = free_bytes()
    region = reserve_region(16 * GIB, "cuda:0")
    assert isinstance(region, CudaVmmRegion)
    assert region.resident_bytes() == 0
    assert before - free_bytes() < 64 << 20  # 16 GiB reserved, (almost) nothing allocated
    g = region.granularity
    data = region.as_tensor(torch.float32, (region.nbytes // 4,))
    base = data.data_ptr()
    region.ensure_backed(0, 2 * g)
    region.ensure_backed(5 * g + 1, 10)  # one byte range inside chunk 5
    assert region.resident_bytes() == 3 * g
    data[: 2 * g // 4] = 1.5
    data[5 * g // 4: 6 * g // 4] = 2.5
    assert data[: 2 * g // 4].sum().item() == 1.5 * (2 * g // 4)
    assert data[5 * g // 4: 6 * g // 4].min().item() == 2.5
    mapped = free_bytes()
    region.release(0, g + g // 2)  # only chunk 0 lies wholly inside
    assert region.resident_bytes() == 2 * g
    assert free_bytes() - mapped >= g  # given back to the driver
    assert data[g // 4: 2 * g // 4].max().item() == 1.5  # chunk 1 untouched
    region.ensure_backed(0, g)
    assert data.data_ptr() == base
    data[: g // 4] = 3.0
    assert data[: g // 4].min().item() == 3.0


def test_region_refuses_ranges_outside_it() -> None:
    from gpu_ext.memory import reserve_region

    region = reserve_region(4 << 20, "cuda:0")
    with pytest.raises(ValueError, match="outside the region"):
        region.ensure_backed(region.nbytes, 1)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from services.gpu_worker.engine.checkpoint_gen import make_model

    return make_model(tmp_path_factory.mktemp("vmm") / "m", arch="llama", layers=4, hidden=64, heads=4,
                      kv_heads=2, vocab=512, seed=7)


def engine_config(model_dir: Path, pool_bytes: int):
    from services.gpu_worker.engine.engine import EngineConfig

    return EngineConfig(str(model_dir), device="cuda:0", pool_bytes=pool_bytes, block_size=16, workspace_bytes=1 << 24)


def run(engine, prompts: list[list[int]], new: int = 24) -> dict[str, list[int]]:
    from services.gpu_worker.engine.sampling_params import SamplingParams

    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", p, SamplingParams(max_tokens=new, temperature=0.0, ignore_eos=True))
    out: dict[str, list[int]] = {}
    while engine.has_unfinished:
        for o in engine.step():
            out.setdefault(o.request_id, []).extend(o.new_token_ids)
    return out


def test_two_instances_on_one_pool_map_only_what_the_pool_gives_them(model_dir: Path) -> None:
    from services.gpu_worker.engine.engine import LLMEngine
    from services.gpu_worker.engine.memory_pool import MemoryPool

    before = free_bytes()
    pool = MemoryPool(2 * GIB, device="cuda:0")
    a = LLMEngine(engine_config(model_dir, 2 * GIB), pool, tenant="a")
    b = LLMEngine(engine_config(model_dir, 2 * GIB), pool, tenant="b")
    ra, rb = a.runner.kv_cache.region, b.runner.kv_cache.region
    mapped = ra.resident_bytes() + rb.resident_bytes()
    kv = pool.breakdown()["kv"]
    assert kv <= mapped <= kv + 4 * ra.granularity  # chunk rounding on each of the K and V halves
    assert before - free_bytes() < 2 * GIB + (256 << 20)  # an eager region per instance would be 4 GiB
    prompts = [[(7 * i + j) % 500 + 3 for j in range(40 + 9 * i)] for i in range(4)]
    assert run(a, prompts) == run(LLMEngine(engine_config(model_dir, 256 << 20)), prompts)


def test_freed_weights_become_kv_in_place_while_requests_decode(model_dir: Path) -> None:
    from services.gpu_worker.engine.engine import LLMEngine
    from services.gpu_worker.engine.memory_pool import MemoryKind, MemoryPool
    from services.gpu_worker.engine.sampling_params import SamplingParams

    pool = MemoryPool(1 * GIB, device="cuda:0")
    prewarmed = pool.charge(MemoryKind.PREWARM, "other-model", 512 << 20)  # a prewarmed model's bytes
    eng = LLMEngine(engine_config(model_dir, 1 * GIB), pool, tenant="a")
    region = eng.runner.kv_cache.region
    base, mapped, blocks = eng.runner.kv_cache.blocks.data_ptr(), region.resident_bytes(), eng.blocks.num_blocks
    prompts = [[(5 * i + j) % 500 + 3 for j in range(30 + 7 * i)] for i in range(3)]
    want = run(LLMEngine(engine_config(model_dir, 256 << 20)), prompts)
    for i, p in enumerate(prompts):
        eng.add_request(f"r{i}", p, SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True))
    out: dict[str, list[int]] = {}
    for _ in range(3):
        for o in eng.step():
            out.setdefault(o.request_id, []).extend(o.new_token_ids)
    pool.release(prewarmed)  # WarmServe: the worker is dedicated; the other model's bytes go to KV
    while eng.has_unfinished:
        for o in eng.step():
            out.setdefault(o.request_id, []).extend(o.new_token_ids)
    assert eng.blocks.num_blocks > blocks
    assert region.resident_bytes() >= mapped + (400 << 20)
    assert eng.runner.kv_cache.blocks.data_ptr() == base  # no new tensor, no copy of live KV
    assert out == want
