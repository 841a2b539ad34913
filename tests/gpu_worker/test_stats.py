"""WorkerStats from instance snapshots (pure): pool sums, holdings, KV growth and token rates."""
from __future__ import annotations

from dataclasses import dataclass, field

from services.gpu_worker.instance_snapshot import InstanceSnapshot
from services.gpu_worker.stats import StatsBuilder, pool_breakdown
from shared.events import MemoryKind, WorkerState

POOL = {
    "weights": {"m:embed": 1000, "m:layer0": 300, "m:layer1": 300, "m:lm_head": 1000},
    "lora": {"lora:a": 50},
    "kv": {"m:kv": 5000},
    "workspace": {"m:activations": 200},
}


@dataclass
class Instance:  # what StatsBuilder reads from a ModelInstance
    instance_id: str
    model: str = "m"
    num_layers: int = 2
    block_bytes: int = 100
    pending: int = 0
    snapshot: InstanceSnapshot = field(default_factory=InstanceSnapshot)
    adapters: frozenset[str] = frozenset()


def snap(ts: float, used: int, emitted: int, **kw: object) -> InstanceSnapshot:
    return InstanceSnapshot(ts=ts, kv_blocks_total=50, kv_blocks_used=used, tokens_emitted=emitted,
                            pool_capacity=10_000, pool_by_owner=POOL, **kw)  # type: ignore[arg-type]


def test_pool_breakdown_sums_kinds_and_names_owners_and_layers() -> None:
    pool = pool_breakdown([("i0", snap(1.0, 0, 0)), ("i1", snap(1.0, 0, 0))])
    assert pool.capacity_bytes == 20_000
    assert pool.weights_bytes == 2 * 2600 and pool.adapter_bytes == 100 and pool.kv_bytes == 10_000
    assert pool.workspace_bytes == 400 and pool.prewarm_bytes == 0
    assert pool.free_bytes == 20_000 - 2 * 7850
    assert sum(h.bytes for h in pool.holdings) == 2 * 7850
    layer1 = [h for h in pool.holdings if h.owner == "i1/m:layer1"]
    assert len(layer1) == 1 and layer1[0].kind is MemoryKind.WEIGHTS and (layer1[0].layers.start, layer1[0].layers.end) == (1, 2)
    assert {h.kind for h in pool.holdings if h.owner.endswith("lora:a")} == {MemoryKind.ADAPTER}


def test_kv_growth_and_token_rate_between_snapshots() -> None:
    inst = Instance("i0", snapshot=snap(10.0, 4, 100, running=3, waiting=1, resident_adapters=("a",)))
    builder = StatsBuilder("w0", "cpu", [inst])  # type: ignore[list-item]
    first = builder.build(WorkerState.READY, now=10.1)
    assert first.seq == 0 and first.instances[0].kv_growth_blocks_per_s == 0.0  # nothing to compare with yet
    assert first.resident_adapters == ["a"] and first.instances[0].running == 3
    inst.snapshot = snap(10.5, 14, 300)
    inst.pending = 2
    second = builder.build(WorkerState.READY, now=10.6)
    assert second.seq == 1
    stats = second.instances[0]
    assert stats.kv_growth_blocks_per_s == 20.0 and stats.tokens_per_s == 400.0  # 10 blocks, 200 tokens in 0.5 s
    assert stats.waiting == 2 and stats.kv_block_bytes == 100 and stats.layers.end == 2
    unchanged = builder.build(WorkerState.DRAINING, now=10.9)  # idle engine: same snapshot, no growth
    assert unchanged.instances[0].kv_growth_blocks_per_s == 0.0 and unchanged.state is WorkerState.DRAINING
    inst.snapshot = snap(11.0, 4, 300)  # an abort freed 10 blocks
    assert builder.build(WorkerState.READY, now=11.1).instances[0].kv_growth_blocks_per_s == -20.0


@dataclass
class Member:  # what StatsBuilder reads of a buddy-group member (group.GroupMember)
    group_id: str | None
    layers: range
    solo: bool = False


def test_a_group_member_reports_its_group_and_stage_else_the_layers_it_holds() -> None:
    alone = Instance("i0", num_layers=4, snapshot=snap(1.0, 0, 0))
    restoring = Instance("i1", num_layers=4, snapshot=snap(1.0, 0, 0, resident_layers=(0, 3)))
    member = Instance("i2", num_layers=4, snapshot=snap(1.0, 0, 0, resident_layers=(0, 4)))
    member.group = Member("g1", range(2, 4))  # type: ignore[attr-defined]  # joined; its weights not dropped yet
    solo = Instance("i3", num_layers=4, snapshot=snap(1.0, 0, 0, resident_layers=(0, 4)))
    solo.group = Member("g2", range(0, 2), solo=True)  # type: ignore[attr-defined]  # migrated back: runs all
    stats = StatsBuilder("w0", "cpu", [alone, restoring, member, solo]).build(WorkerState.READY, now=2.0)  # type: ignore[list-item]
    got = {i.instance_id: (i.group_id, i.layers.start, i.layers.end) for i in stats.instances}
    assert got == {"i0": (None, 0, 4), "i1": (None, 0, 3), "i2": ("g1", 2, 4), "i3": ("g2", 0, 4)}


def test_a_step_longer_than_the_stats_interval_carries_the_last_token_rate() -> None:
    inst = Instance("i0", snapshot=snap(10.0, 4, 100, running=3))
    builder = StatsBuilder("w0", "cpu", [inst])  # type: ignore[list-item]
    builder.build(WorkerState.READY, now=10.1)
    inst.snapshot = snap(10.5, 14, 300, running=3)
    assert builder.build(WorkerState.READY, now=10.6).instances[0].tokens_per_s == 400.0
    # no step ended since (the same snapshot): still decoding at the last rate, not 0
    assert builder.build(WorkerState.READY, now=11.6).instances[0].tokens_per_s == 400.0
    inst.snapshot = snap(10.5, 14, 300)  # nothing running: no rate to carry
    assert builder.build(WorkerState.READY, now=12.6).instances[0].tokens_per_s == 0.0


def test_no_token_rate_over_an_interval_that_began_idle() -> None:
    inst = Instance("i0", snapshot=snap(10.0, 0, 100))  # idle: nothing running
    builder = StatsBuilder("w0", "cpu", [inst])  # type: ignore[list-item]
    builder.build(WorkerState.READY, now=10.1)
    inst.snapshot = snap(64.0, 4, 101, running=1)  # its first step after 54 s idle: 1 token
    assert builder.build(WorkerState.READY, now=64.1).instances[0].tokens_per_s == 0.0  # not 1/54
    assert builder.build(WorkerState.READY, now=65.1).instances[0].tokens_per_s == 0.0  # nothing to carry
    inst.snapshot = snap(64.5, 5, 111, running=1)
    assert builder.build(WorkerState.READY, now=65.2).instances[0].tokens_per_s == 20.0


def test_prefill_pace_over_the_prefill_steps_only_and_carried_while_none_run() -> None:
    inst = Instance("i0", snapshot=snap(10.0, 0, 0))
    builder = StatsBuilder("w0", "cpu", [inst])  # type: ignore[list-item]
    assert builder.build(WorkerState.READY, now=10.1).instances[0].prefill_tokens_per_s == 0.0  # never measured
    # 1,000 prompt tokens in prefill steps of 4 s in all, over a 30 s interval (decode steps and idle time between)
    inst.snapshot = snap(40.0, 10, 5, running=1, prefill_tokens=1000, prefill_s=4.0)
    assert builder.build(WorkerState.READY, now=40.1).instances[0].prefill_tokens_per_s == 250.0
    inst.snapshot = snap(80.0, 0, 50, prefill_tokens=1000, prefill_s=4.0)  # no prefill since: still the last pace
    assert builder.build(WorkerState.READY, now=80.1).instances[0].prefill_tokens_per_s == 250.0
    inst.snapshot = snap(81.0, 10, 51, running=1, prefill_tokens=1500, prefill_s=5.0)
    assert builder.build(WorkerState.READY, now=81.1).instances[0].prefill_tokens_per_s == 500.0
