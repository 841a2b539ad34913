"""WorkerStats of instances on one shared pool (pure): capacity counted once, each instance's share."""
from __future__ import annotations

from dataclasses import dataclass

from services.gpu_worker.instance_snapshot import InstanceSnapshot
from services.gpu_worker.stats import StatsBuilder
from shared.events import WorkerState


@dataclass
class Instance:  # what StatsBuilder reads from a ModelInstance
    instance_id: str
    snapshot: InstanceSnapshot
    model: str = "m"
    num_layers: int = 2
    block_bytes: int = 100
    pending: int = 0
    adapters: frozenset[str] = frozenset()


def snap(kv_held: int, kv_used: int, weights: int, lora: int = 0) -> InstanceSnapshot:
    owners = {"weights": {"m:layer0": weights}, "workspace": {"m:activations": 50},
              "kv": {"m:kv": kv_held * 100}, "lora": {"lora:x": lora} if lora else {}}
    return InstanceSnapshot(ts=1.0, kv_blocks_total=60, kv_blocks_used=kv_used, kv_blocks_held=kv_held,
                            pool_capacity=10_000, pool_id=7, pool_by_owner=owners)


def test_a_shared_pool_is_counted_once_and_each_instance_shows_its_share() -> None:
    a, b = Instance("a", snap(40, 30, 1000)), Instance("b", snap(10, 10, 2000, lora=300))
    msg = StatsBuilder("w0", "cpu", [a, b]).build(WorkerState.READY, now=1.0)  # type: ignore[list-item]
    pool = msg.pool
    assert pool.capacity_bytes == 10_000 and pool.kv_bytes == 5000 and pool.weights_bytes == 3000
    assert pool.free_bytes == 10_000 - 5000 - 3000 - 300 - 100
    ia, ib = msg.instances
    assert (ia.kv_used_bytes, ia.kv_free_bytes, ia.weights_bytes, ia.workspace_bytes) == (3000, 1000, 1000, 50)
    assert (ib.kv_used_bytes, ib.kv_free_bytes, ib.adapter_bytes) == (1000, 0, 300)
    shares = sum(i.kv_used_bytes + i.kv_free_bytes + i.weights_bytes + i.adapter_bytes + i.workspace_bytes
                 for i in msg.instances)
    assert shares + pool.free_bytes == pool.capacity_bytes
