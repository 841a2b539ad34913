"""A real gpu_worker serving two models on ONE pool: WorkerStats shows each instance's share,
and the KV split follows the load — the busy model holds the KV, then gives its free blocks
to the other when that one gets traffic."""
from __future__ import annotations

from pathlib import Path

import msgspec

from service_procs import ServiceProcess, eventually, wait_ready
from services.gpu_worker.engine.checkpoint_gen import make_model
from shared.bus import Bus, BusSettings
from shared.events import AssignAccepted, AssignReply, InstanceStats, TokenChunk, WorkerStats
from shared.subjects import worker_assign, worker_stats
from worker_harness import assignment, watch

CONFIG = """
[[models]]
name = "one"
path = "{one}"
max_context = 512

[[models]]
name = "two"
path = "{two}"
max_context = 512

[[workers]]
id = "w0"
device = "cpu"
memory = "8MiB"
models = ["one", "two"]
stream_interval = "20ms"

[policies]
max_batch_size = 8
step_token_budget = 256
kv_block_tokens = 8
"""


def share(inst: InstanceStats) -> int:
    return inst.kv_used_bytes + inst.kv_free_bytes + inst.weights_bytes + inst.adapter_bytes + inst.workspace_bytes


def kv_held(inst: InstanceStats) -> int:
    return inst.kv_used_bytes + inst.kv_free_bytes


async def test_two_models_share_the_pool_and_the_kv_split_follows_the_load(tmp_path: Path, nats_url: str) -> None:
    dims = dict(layers=2, hidden=64, heads=4, kv_heads=2, vocab=512)
    one = make_model(tmp_path / "one", arch="llama", seed=3, **dims)
    two = make_model(tmp_path / "two", arch="qwen2", seed=5, **dims)
    config = tmp_path / "cluster.toml"
    config.write_text(CONFIG.format(one=one, two=two))
    worker = ServiceProcess("gpu_worker", nats_url, config, "worker-shared", "--worker-id", "w0", "--threads", "1",
                            "--stats-interval", "0.05").start()
    bus = await Bus.connect(BusSettings(url=nats_url), service="test")
    try:
        await wait_ready(bus, worker, timeout=60)
        stats: list[WorkerStats] = []

        async def on_stats(msg: WorkerStats, _ctx: object) -> None:
            stats.append(msg)

        await bus.subscribe(worker_stats(), WorkerStats, on_stats)

        async def until(check, timeout: float) -> dict[str, InstanceStats]:  # type: ignore[no-untyped-def]
            """The instances of the latest stats message that passes `check(msg, by_model)`."""
            async def latest() -> dict[str, InstanceStats] | None:
                for msg in reversed(stats):
                    by_model = {i.model: i for i in msg.instances}
                    if len(by_model) == 2 and check(msg, by_model):
                        return by_model
                return None
            return await eventually(latest, timeout=timeout)

        # Idle: one pool; the instances' shares and the free bytes make its capacity
        def idle(msg: WorkerStats, m: dict[str, InstanceStats]) -> bool:
            return sum(share(i) for i in m.values()) + msg.pool.free_bytes == msg.pool.capacity_bytes == 8 << 20

        start = await until(idle, timeout=10)
        assert all(i.weights_bytes > 0 and i.workspace_bytes > 0 for i in start.values())
        total = start["one"].kv_blocks_total
        assert total == start["two"].kv_blocks_total > 1000  # each could hold all the pool's KV: routable
        block = start["one"].kv_block_bytes

        async def send(model: str, rid: str, prompt: list[int], max_tokens: int):  # type: ignore[no-untyped-def]
            stream = await watch(bus, rid)
            a = msgspec.structs.replace(assignment(rid, prompt, max_tokens=max_tokens), model=model,
                                        instance_id=f"w0-{model}")
            assert isinstance(await bus.request(worker_assign("w0"), a, AssignReply), AssignAccepted)
            return stream

        # Load on "one" only: it holds the KV, "two" none
        ones = [await send("one", f"one-{i}", [1] + [50 + i] * 150, 300) for i in range(4)]

        def one_busy(msg: WorkerStats, m: dict[str, InstanceStats]) -> bool:
            return m["one"].kv_used_bytes >= 4 * 2 * 19 * block and kv_held(m["two"]) == 0

        busy = await until(one_busy, timeout=20)
        held_before = kv_held(busy["one"])
        assert held_before > (total // 2) * block  # nearly all the pool's KV sits at "one"
        # Load shifts to "two" while "one" still runs: "two" takes free blocks "one" held
        twos = [await send("two", f"two-{i}", [1] + [80 + i] * 200, 60) for i in range(4)]

        def shifted(msg: WorkerStats, m: dict[str, InstanceStats]) -> bool:
            return m["two"].kv_used_bytes >= 4 * 2 * 25 * block and m["one"].running > 0

        moved = await until(shifted, timeout=30)
        assert kv_held(moved["one"]) < held_before and kv_held(moved["two"]) >= moved["two"].kv_used_bytes
        for stream in ones + twos:
            await stream.wait(timeout=60)
            final = stream.final
            assert isinstance(final, TokenChunk) and final.finish_reason == "length"
        stats.clear()
        end = await until(lambda msg, m: idle(msg, m) and all(i.running == 0 and i.kv_used_bytes == 0
                                                              for i in m.values()), timeout=10)
        assert kv_held(end["two"]) > 0  # kept as free blocks until "one" needs them again
    finally:
        await bus.close()
        worker.stop()

