"""Engines started on weights already in memory (WarmServe's prewarmed slots), the real runner on CPU.

A retired engine's weights start a new engine with no checkpoint file opened and token-exact
outputs; warm weights in the pool switch kind (weights -> prewarm -> weights) without the bytes
ever being free, and are given up whole when a serving instance's KV needs them; an engine that
holds only its first layers serves its first prefill while the other layers are still loading.
"""
from __future__ import annotations

import threading
from pathlib import Path

import pytest

from services.gpu_worker.engine.checkpoint_gen import make_model
from services.gpu_worker.engine.engine import EngineConfig, LLMEngine
from services.gpu_worker.engine.loader import CHECKPOINT_OPENS
from services.gpu_worker.engine.memory_pool import MemoryKind, MemoryPool
from services.gpu_worker.engine.model_config import load_model_config
from services.gpu_worker.engine.preloaded import PreloadedWeights, model_weight_bytes
from services.gpu_worker.engine.sampling_params import SamplingParams
from services.gpu_worker.prewarm import PREWARM_TENANT, PrewarmStore

PROMPTS = [[1, 20, 30, 40, 50, 60, 70], [1, 99, 98, 97]]
PARAMS = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_model(tmp_path_factory.mktemp("m") / "m", arch="llama", layers=4, hidden=64, heads=4, kv_heads=2,
                      vocab=512, seed=7)


def config(model_dir: Path) -> EngineConfig:
    return EngineConfig(str(model_dir), pool_bytes=32 << 20, block_size=4, workspace_bytes=1 << 16)


def outputs(engine: LLMEngine) -> list[list[int]]:
    return [r.token_ids for r in engine.generate(PROMPTS, PARAMS)]


def test_weights_estimate_matches_what_a_runner_charges(model: Path) -> None:
    engine = LLMEngine(config(model))
    total, layer = model_weight_bytes(load_model_config(model))
    assert engine.pool.bytes_of(MemoryKind.WEIGHTS) == total
    assert engine.pool.bytes_of(MemoryKind.WEIGHTS, f"{engine.runner.cfg.name}:layer1") == layer


def test_a_retired_engines_weights_start_a_new_one_without_reading_the_checkpoint(model: Path) -> None:
    pool = MemoryPool(32 << 20)
    first = LLMEngine(config(model), pool, tenant="one")
    expected = outputs(first)
    weights = pool.bytes_of(MemoryKind.WEIGHTS)
    store = PrewarmStore(pool)
    kept = store.put("m", PreloadedWeights.from_runner(first.runner), source="evicted", from_tenant="one")
    assert kept == weights == pool.bytes_of(MemoryKind.PREWARM, tenant=PREWARM_TENANT)
    assert pool.bytes_of(MemoryKind.WEIGHTS) == 0 and pool.bytes_of(MemoryKind.KV) == 0  # the rest of "one" freed
    warm = store.take("m")
    assert warm is not None and warm.covers(4) and pool.bytes_of(MemoryKind.PREWARM) == 0
    opens = CHECKPOINT_OPENS[0]
    second = LLMEngine(config(model), pool, tenant="two", preloaded=warm)
    assert CHECKPOINT_OPENS[0] == opens  # no safetensors file opened
    assert second.runner.model.layers[2].wqkv is warm.layers[2].wqkv  # the same tensors: no copy
    assert pool.bytes_of(MemoryKind.WEIGHTS) == weights
    assert outputs(second) == expected


def test_warm_weights_are_given_up_for_a_serving_instances_kv(model: Path) -> None:
    probe = LLMEngine(config(model))
    need = probe.pool.bytes_of(MemoryKind.WEIGHTS) + (1 << 16)
    block = probe.blocks.block_bytes * len(probe.blocks.layers)
    warm = PreloadedWeights.read(model, load_model_config(model), range(0, 4), "cpu")
    pool = MemoryPool(need + warm.nbytes + 8 * block)  # room for 8 blocks per layer beside the warm model
    store = PrewarmStore(pool)
    store.put("other", warm, source="prewarm")
    engine = LLMEngine(config(model), pool, tenant="serving")
    long_prompt = [[1] + [5 + i for i in range(60)]]  # needs more blocks than the free bytes give
    [result] = engine.generate(long_prompt, PARAMS)
    assert len(result.token_ids) == PARAMS.max_tokens
    assert "other" not in store.models and pool.bytes_of(MemoryKind.PREWARM) == 0


def test_first_layers_serve_while_the_rest_load(model: Path) -> None:
    expected = outputs(LLMEngine(config(model)))
    first_two = PreloadedWeights.read(model, load_model_config(model), range(0, 2), "cpu")
    gate, reached = threading.Event(), threading.Event()
    pool = MemoryPool(32 << 20)
    engine = LLMEngine(config(model), pool, tenant="t", preloaded=first_two, background_load=True)
    loader = engine.runner.loading
    assert loader is not None and loader.pending == [2, 3]
    # hold layer 2 back until the first step has computed the warm layers and waits for it
    loader.before_layer = lambda i: gate.wait(10) if i == 2 else None
    original = loader.wait_for

    def wait_for(layer: int) -> None:
        if layer == 2:
            reached.set()
        original(layer)

    loader.wait_for = wait_for  # type: ignore[method-assign]
    released = threading.Thread(target=lambda: (reached.wait(10), gate.set()))
    released.start()
    got = outputs(engine)
    released.join()
    assert reached.is_set() and engine.runner.loading is None
    assert sorted(engine.runner.model.layers) == [0, 1, 2, 3]
    assert got == expected


def test_a_prewarm_read_waits_before_each_layer_while_the_worker_serves_and_no_longer_than_its_budget(
        model: Path) -> None:
    from services.gpu_worker.prewarm import ServingGate

    cfg = load_model_config(model)
    served = threading.Event()  # the "worker" serves until this is set
    calls: list[bool] = []

    def serving() -> bool:
        calls.append(not served.is_set())
        return not served.is_set()

    gate = ServingGate(serving, max_wait_s=60.0, poll_s=0.005)
    result: list[PreloadedWeights] = []
    reader = threading.Thread(target=lambda: result.append(PreloadedWeights.read(model, cfg, range(0, 2), "cpu", gate)))
    reader.start()
    reader.join(timeout=0.3)
    assert reader.is_alive() and not result  # no layer read while requests run
    served.set()
    reader.join(timeout=30)
    assert result and sorted(result[0].layers) == [0, 1] and gate.pauses == 1 and gate.waited_s > 0
    # a worker that never idles: the read waits its budget once, then reads every layer on
    never = ServingGate(lambda: True, max_wait_s=0.05, poll_s=0.005)
    warm = PreloadedWeights.read(model, cfg, range(0, 4), "cpu", never)
    assert sorted(warm.layers) == [0, 1, 2, 3] and never.pauses == 1 and 0.05 <= never.waited_s < 5
    with pytest.raises(ValueError):
        ServingGate(lambda: False, max_wait_s=-1)
