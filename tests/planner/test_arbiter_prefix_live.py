"""Cached prefix blocks bought by the live planner: a real nats-server, a registry and a planner process
with `economy = "arbiter"`. A worker (this test: its stats and its ctl subject) is above the KV watermark
with requests waiting, and one instance holds 20 MiB of cached-free prefix blocks it rarely hits. The
planner buys them (a PlanPurchased with a bought `prefix` offer) and sends `EvictPrefixBlocks` with that
purchase's plan id to the worker, once."""
from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest

from shared.bus import Bus, BusSettings, Delivery
from shared.events.common import LayerRange
from shared.events.ctl import CtlDone, EvictPrefixBlocks
from shared.events.plan import PlanDecided, PlanPurchased, ReleasePrefixBlocks
from shared.events.worker import InstanceStats, PoolBreakdown, WorkerState, WorkerStats
from shared.subjects import plan_event, worker_ctl, worker_stats

from service_procs import FAST_LIVENESS, eventually, local_cluster, write_config

pytestmark = pytest.mark.timeout(120)
MIB = 1 << 20
CONFIG = FAST_LIVENESS + """
[planner]
interval = "300ms"
economy = "arbiter"
cost_profile = "cpu"

[policies]
buddy_groups = false
migration = "off"
"""


def needy_stats(seq: int, cached_entries: int) -> WorkerStats:
    """w1: 75 MiB of 100 MiB of KV live, `cached_entries` x 512 KiB cached-free (hit rate 0.05), 4 waiting."""
    pool = PoolBreakdown(capacity_bytes=110 * MIB, weights_bytes=10 * MIB, kv_bytes=100 * MIB, free_bytes=0)
    inst = InstanceStats(instance_id="w1-m", model="m", layers=LayerRange(start=0, end=4), running=2, waiting=4,
                         queued_prompt_tokens=2000, kv_blocks_total=1600, kv_blocks_used=1200, kv_block_bytes=64 << 10,
                         prefix_cached_free_blocks=cached_entries, prefix_cached_free_bytes=cached_entries * 512 * 1024,
                         prefix_hit_rate=0.05)
    return WorkerStats(worker_id="w1", seq=seq, ts=time.time(), device="cpu", state=WorkerState.READY, pool=pool,
                       instances=[inst])


def test_the_planner_buys_cold_cached_prefixes_and_the_worker_is_told_to_evict_them(tmp_path: Path) -> None:
    config = write_config(tmp_path, CONFIG)
    with local_cluster(tmp_path) as services:
        services.start("registry", config, "registry-t")
        services.start("planner", config, "planner-a")
        services.wait_ready(timeout=60)
        asyncio.run(_scenario(services.url))


async def _scenario(url: str) -> None:
    bus = await Bus.connect(BusSettings(url=url), service="test")
    events: list[PlanPurchased | PlanDecided] = []
    evictions: list[EvictPrefixBlocks] = []
    cached = 40

    async def on_event(msg, _ctx: Delivery) -> None:  # type: ignore[no-untyped-def]
        events.append(msg)

    async def on_evict(msg: EvictPrefixBlocks, _ctx: Delivery) -> CtlDone:
        nonlocal cached
        evictions.append(msg)
        cached = max(0, cached - msg.blocks)  # released: the next stats show none cached
        return CtlDone(idempotency_key=msg.idempotency_key, command="EvictPrefixBlocks", worker_id="w1",
                       detail=f"{msg.blocks} of {msg.blocks} cached prefix blocks of w1-m released")

    async def publish_stats() -> None:
        seq = 0
        while True:
            seq += 1
            await bus.publish(worker_stats(), needy_stats(seq, cached))
            await asyncio.sleep(0.1)

    async def evicted() -> bool:
        return bool(evictions)

    try:
        await bus.subscribe(plan_event("purchased"), PlanPurchased, on_event)
        await bus.subscribe(plan_event("decided"), PlanDecided, on_event)
        await bus.subscribe(worker_ctl("w1"), EvictPrefixBlocks, on_evict)
        stats = asyncio.create_task(publish_stats())
        try:
            await eventually(evicted, timeout=20)
            bought = next(e for e in events if isinstance(e, PlanPurchased) and e.bought_bytes)
            (offer,) = [p for p in bought.prices if p.bought]
            assert offer.source == "prefix" and offer.target == "w1/w1-m" and offer.bytes == 20 * MIB
            assert offer.price_request_s == pytest.approx(0.05 * 1280 * 5e-4)  # 20 MiB = 1280 tokens of 16 KiB
            (cmd,) = evictions
            assert cmd.instance_id == "w1-m" and cmd.blocks == 40 and cmd.plan_id == offer.plan_ids[0]
            decided = next(e for e in events if isinstance(e, PlanDecided) and e.plan.plan_id == cmd.plan_id)
            assert decided.plan.actions == [ReleasePrefixBlocks(worker_id="w1", instance_id="w1-m", blocks=40)]
            await asyncio.sleep(1.0)
            assert len(evictions) == 1  # bought once; nothing cached is left to buy
        finally:
            stats.cancel()
    finally:
        await bus.close()
