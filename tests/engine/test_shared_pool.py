"""Two engines of two generated models on ONE memory pool (the real runner, CPU, fp32).

KV moves between them on demand: the busy one holds nearly the whole pool while the other
is idle; a newcomer takes the busy one's free blocks, or waits while they are all live and
gets them as they are freed; freed bytes of another kind are KV within one step. Outputs
stay token-exact against each model alone on a private pool.
"""
from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest

from services.gpu_worker.engine.checkpoint_gen import make_lora, make_model
from services.gpu_worker.engine.engine import EngineConfig, LLMEngine
from services.gpu_worker.engine.memory_pool import MemoryKind, MemoryPool
from services.gpu_worker.engine.sampling_params import SamplingParams

BLOCK_TOKENS = 4
WORKSPACE = 1 << 16
KV_BLOCKS = 140  # of the shared pool, beyond both models' weights and workspaces


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("models")
    dims = dict(layers=2, hidden=64, heads=4, kv_heads=2, vocab=512)  # equal block bytes
    return {"a": make_model(root / "a", arch="llama", seed=3, **dims),
            "b": make_model(root / "b", arch="qwen2", seed=5, **dims)}


def config(model_dir: Path, **kw: object) -> EngineConfig:
    return EngineConfig(str(model_dir), **{"pool_bytes": 64 << 20, "block_size": BLOCK_TOKENS,
                                           "workspace_bytes": WORKSPACE, **kw})  # type: ignore[arg-type]


def shared_engines(models: dict[str, Path], kv_blocks: int = KV_BLOCKS,
                   **kw: object) -> tuple[MemoryPool, dict[str, LLMEngine]]:
    fixed = 0
    for path in models.values():
        probe = LLMEngine(config(path))
        fixed += probe.pool.breakdown()["weights"] + WORKSPACE
        block = probe.blocks.block_bytes
    pool = MemoryPool(fixed + kv_blocks * block)
    return pool, {name: LLMEngine(config(path, **kw), pool, tenant=name) for name, path in models.items()}


def alone(model_dir: Path, requests: list[tuple[str, list[int], SamplingParams]]) -> dict[str, list[int]]:
    eng = LLMEngine(config(model_dir))
    for rid, prompt, params in requests:
        eng.add_request(rid, prompt, params)
    return drive({"x": eng})


def drive(engines: dict[str, LLMEngine], out: dict[str, list[int]] | None = None,
          max_rounds: int = 5000) -> dict[str, list[int]]:
    """Step every engine in turn until all are done; tokens per request id."""
    out = {} if out is None else out
    for _ in range(max_rounds):
        if not any(e.has_unfinished for e in engines.values()):
            return out
        for eng in engines.values():
            if eng.has_unfinished:
                step(eng, out)
    raise AssertionError("engines did not finish")


def step(eng: LLMEngine, out: dict[str, list[int]]) -> None:
    for delta in eng.step():
        assert delta.finish_reason in (None, "length"), delta.error
        out.setdefault(delta.request_id, []).extend(delta.new_token_ids)
    assert_blocks_consistent(eng)


def assert_blocks_consistent(eng: LLMEngine) -> None:
    """No block is in two tables, every used block is in one: nothing live was given away."""
    blocks = eng.blocks
    ids = [b for seq in eng.scheduler.running for t in blocks.block_tables(seq.seq_id).values() for b in t]
    assert len(ids) == len(set(ids)) == blocks.num_used_blocks
    assert all(b < blocks.block_id_limit for b in ids)
    assert eng.pool.bytes_of(MemoryKind.KV) == blocks.num_blocks * blocks.block_bytes


def prompt(n: int, start: int) -> list[int]:
    return [(start + 7 * i) % 500 + 3 for i in range(n)]


GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
SEEDED = SamplingParams(temperature=0.9, top_p=0.9, seed=11, max_tokens=16, ignore_eos=True)


def test_the_busy_one_holds_nearly_the_whole_pool_and_the_idle_one_gets_its_share(models: dict[str, Path]) -> None:
    pool, engines = shared_engines(models)
    a, b = engines["a"], engines["b"]
    reqs_a = [(f"a{i}", prompt(40, i), GREEDY if i % 2 else SEEDED) for i in range(3)]
    # at their longest: a 3 x 28 blocks, b 2 x 24 (2 layers, 4 tokens a block), 132 of 140
    reqs_b = [(f"b{i}", prompt(32, 50 + i), GREEDY if i else SEEDED) for i in range(2)]
    for rid, p, params in reqs_a:
        a.add_request(rid, p, params)
    out: dict[str, list[int]] = {}
    for _ in range(4):
        step(a, out)
    # a alone is busy: it holds every KV block of the pool; b, idle, none
    assert a.blocks.num_blocks == KV_BLOCKS and b.blocks.num_blocks == 0
    assert b.blocks.capacity_blocks == KV_BLOCKS  # what b could hold: it is routable and nothing fits-at-all fails
    live_a = a.blocks.num_used_blocks
    assert KV_BLOCKS - live_a - a.blocks.floor > 2 * 16  # free blocks at a beyond its floor: room for b
    for rid, p, params in reqs_b:
        b.add_request(rid, p, params)
    step(b, out)  # b claims a's FREE blocks at once, and admits both
    assert b.scheduler.num_running == 2 and b.blocks.num_blocks >= b.blocks.num_used_blocks > 0
    assert a.blocks.num_used_blocks == live_a and a.blocks.num_blocks == KV_BLOCKS - b.blocks.num_blocks
    drive(engines, out)
    assert a.scheduler.num_preemptions == b.scheduler.num_preemptions == 0
    assert {r: out[r] for r, _, _ in reqs_a} == alone(models["a"], reqs_a)
    assert {r: out[r] for r, _, _ in reqs_b} == alone(models["b"], reqs_b)
    # the pool adds up: both instances' KV, their weights and workspaces, and what is free
    kinds = pool.breakdown()
    assert sum(kinds.values()) == pool.capacity_bytes
    assert kinds["kv"] == (a.blocks.num_blocks + b.blocks.num_blocks) * a.blocks.block_bytes
    # roles swap: b, idle now, gives its free blocks to a's new burst
    held_b = b.blocks.num_blocks
    a.add_request("late", prompt(200, 9), GREEDY)
    step(a, out)
    assert b.blocks.num_blocks < held_b and a.scheduler.num_running == 1


def test_a_newcomer_waits_while_the_busy_ones_blocks_are_live_and_gets_them_first(models: dict[str, Path]) -> None:
    pool, engines = shared_engines(models, max_num_batched_tokens=200)
    a, b = engines["a"], engines["b"]
    long = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    short = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    # a0 and a1: 50 blocks each at admission; a2 finds no room (budget, then blocks) and waits
    reqs_a = [("a0", prompt(100, 1), short), ("a1", prompt(100, 2), long), ("a2", prompt(100, 3), short)]
    for rid, p, params in reqs_a:
        a.add_request(rid, p, params)
    out: dict[str, list[int]] = {}
    step(a, out)
    assert a.scheduler.num_running == 2 and a.scheduler.num_waiting == 1
    # b's request needs 40 blocks: more than a's free blocks above its floor
    b.add_request("b0", prompt(80, 4), GREEDY)
    live_a = a.blocks.num_used_blocks
    step(b, out)
    assert b.scheduler.num_running == 0 and b.scheduler.num_waiting == 1  # it waits; a's live KV is a's
    assert a.blocks.num_used_blocks == live_a
    assert pool.wanted_by_others("a") > 0  # filed: a gives back what it frees
    rounds, admitted_at, a0_done_at = 0, None, None
    while b.scheduler.num_running == 0 and rounds < 100:
        rounds += 1
        step(a, out)
        if a0_done_at is None and a.scheduler.get("a0") is None:
            a0_done_at = rounds
        step(b, out)
        if b.scheduler.num_running:
            admitted_at = rounds
    assert a0_done_at is not None and admitted_at is not None
    assert admitted_at <= a0_done_at + 1  # the blocks a0 freed went to b at a's next step
    drive(engines, out)
    assert {r: out[r] for r, _, _ in reqs_a} == alone(models["a"], reqs_a)
    assert out["b0"] == alone(models["b"], [("b0", prompt(80, 4), GREEDY)])["b0"]


def test_an_evicted_adapter_is_kv_of_the_other_instance_at_its_next_step(models: dict[str, Path],
                                                                         tmp_path: Path) -> None:
    lora = make_lora(tmp_path / "lora", models["b"], rank=4, targets=["q", "k", "v", "o"])
    pool, engines = shared_engines(models, kv_blocks=60)
    a, b = engines["a"], engines["b"]
    b.add_lora("x", lora)
    b.runner.lora.ensure_resident(["x"])  # its bytes come from the KV a held (free blocks)
    assert pool.bytes_of(MemoryKind.LORA) // a.blocks.block_bytes > 12
    out: dict[str, list[int]] = {}
    b.add_request("b0", prompt(24, 8), GREEDY)
    step(b, out)  # 12 live blocks at b
    big = prompt(72, 5)  # 36 blocks to start: a gets no more than 60 - adapter - b's
    a.add_request("big", big, GREEDY)
    step(a, out)
    assert a.scheduler.num_waiting == 1 and a.blocks.num_blocks < 36
    b.remove_lora("x")  # the adapter's bytes are free
    step(a, out)  # one step later they are a's blocks, and the request runs
    assert a.scheduler.num_running == 1 and a.blocks.num_used_blocks >= 36
    drive(engines, out)
    assert out["big"] == alone(models["a"], [("big", big, GREEDY)])["big"]
    assert out["b0"] == alone(models["b"], [("b0", prompt(24, 8), GREEDY)])["b0"]


def test_engines_on_their_own_threads_share_the_pool_token_exact(models: dict[str, Path]) -> None:
    pool, engines = shared_engines(models, kv_blocks=90, max_num_seqs=4)
    reqs = {name: [(f"{name}{i}", prompt(30 + 9 * i, 17 * i + (name == "b")), GREEDY if i % 2 else SEEDED)
                   for i in range(4)] for name in engines}
    results: dict[str, dict[str, list[int]]] = {}
    most: dict[str, int] = {}  # the most blocks each held

    def serve(name: str) -> None:
        eng = engines[name]
        for rid, p, params in reqs[name]:
            eng.add_request(rid, p, params)
        out: dict[str, list[int]] = {}
        while eng.has_unfinished:
            step(eng, out)
            most[name] = max(most.get(name, 0), eng.blocks.num_blocks)
            if eng.stalled:  # waiting for KV the other thread holds: as the worker's engine thread does
                time.sleep(0.001)
        results[name] = out

    threads = [threading.Thread(target=serve, args=(name,)) for name in engines]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sum(most.values()) > 90  # blocks went from one instance to the other
    for name, path in models.items():
        assert results[name] == alone(path, reqs[name])
    kinds = pool.breakdown()
    assert sum(kinds.values()) == pool.capacity_bytes
    assert kinds["kv"] == sum(e.blocks.num_blocks * e.blocks.block_bytes for e in engines.values())
