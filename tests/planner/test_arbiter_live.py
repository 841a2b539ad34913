"""The memory arbiter in the live planner: a real nats-server, a registry process and two planner
processes with `economy = "arbiter"`. A worker (this test: its stats and its ctl subject) is above the KV
watermark with requests waiting and a prewarmed replica. The lease holder buys the replica's release:
its PlanPurchased comes before the PlanDecided of the effect that carries it out, with that effect's plan
id; the EvictModel reaches the worker once (one planner buys); `planner.purchases` is answered by the
lease holder alone, and after it stops, by the new holder."""
from __future__ import annotations

import asyncio
import time
from pathlib import Path

import msgspec
import pytest

from shared.bus import Bus, BusSettings, Delivery
from shared.events.common import LayerRange
from shared.events.ctl import CtlDone, EvictModel
from shared.events.plan import PlanDecided, PlanPurchased, PurchaseLogReply, PurchaseLogRequest
from shared.events.registry import Bucket, LeaseRecord
from shared.events.worker import InstanceStats, MemoryHolding, PoolBreakdown, WorkerState, WorkerStats
from shared.registry_client import RegistryClient
from shared.subjects import plan_event, planner_purchases, worker_ctl, worker_stats
from shared.wire import encode

from service_procs import FAST_LIVENESS, eventually, local_cluster, write_config

pytestmark = pytest.mark.timeout(120)

CONFIG = FAST_LIVENESS + """
[planner]
interval = "300ms"
lease_ttl = "1s"
economy = "arbiter"
cost_profile = "cpu"

[policies]
buddy_groups = false
migration = "off"
"""
MIB = 1 << 20


def needy_stats(seq: int, prewarm: bool) -> WorkerStats:
    """w1: 95 of 100 MiB of KV in use, 4 requests waiting on 2000 prompt tokens, model p's 8 MiB prewarmed."""
    holdings = [MemoryHolding(kind="prewarm", owner="prewarm/p:0", bytes=8 * MIB)] if prewarm else []
    pool = PoolBreakdown(capacity_bytes=110 * MIB, weights_bytes=2 * MIB, prewarm_bytes=8 * MIB if prewarm else 0,
                         kv_bytes=100 * MIB, free_bytes=0 if prewarm else 8 * MIB, holdings=holdings)
    inst = InstanceStats(instance_id="w1-m", model="m", layers=LayerRange(start=0, end=4), running=2, waiting=4,
                         queued_prompt_tokens=2000, kv_blocks_total=1600, kv_blocks_used=1520, kv_block_bytes=64 << 10)
    return WorkerStats(worker_id="w1", seq=seq, ts=time.time(), device="cpu", state=WorkerState.READY, pool=pool,
                       instances=[inst])


async def collect_replies(bus: Bus, timeout: float = 1.0) -> list[PurchaseLogReply]:
    """Every answer to one PurchaseLogRequest within `timeout` (a second answerer would show up here)."""
    replies: list[PurchaseLogReply] = []
    inbox = bus.nc.new_inbox()

    async def on_reply(msg) -> None:  # type: ignore[no-untyped-def]
        replies.append(msgspec.msgpack.decode(msg.data, type=PurchaseLogReply))

    sub = await bus.nc.subscribe(inbox, cb=on_reply)
    try:
        await bus.nc.publish(planner_purchases(), encode(PurchaseLogRequest(limit=5)), reply=inbox)
        await asyncio.sleep(timeout)
    finally:
        await sub.unsubscribe()
    return replies


def test_purchases_are_published_before_their_effects_and_served_by_the_leader_only(tmp_path: Path) -> None:
    config = write_config(tmp_path, CONFIG)
    with local_cluster(tmp_path) as services:
        services.start("registry", config, "registry-t")
        services.start("planner", config, "planner-a")
        services.start("planner", config, "planner-b")
        services.wait_ready(timeout=60)
        asyncio.run(_scenario(services))


async def _scenario(services) -> None:  # type: ignore[no-untyped-def]
    bus = await Bus.connect(BusSettings(url=services.url), service="test")
    events: list[PlanPurchased | PlanDecided] = []
    evictions: list[EvictModel] = []
    prewarmed = True

    async def on_event(msg, _ctx: Delivery) -> None:  # type: ignore[no-untyped-def]
        events.append(msg)

    async def on_evict(msg: EvictModel, _ctx: Delivery) -> CtlDone:
        nonlocal prewarmed
        evictions.append(msg)
        prewarmed = False  # the replica is gone: the next stats show its bytes free
        return CtlDone(idempotency_key=msg.idempotency_key, command="EvictModel", worker_id="w1")

    async def publish_stats() -> None:
        seq = 0
        while True:
            seq += 1
            await bus.publish(worker_stats(), needy_stats(seq, prewarmed))
            await asyncio.sleep(0.1)

    try:
        await bus.subscribe(plan_event("purchased"), PlanPurchased, on_event)
        await bus.subscribe(plan_event("decided"), PlanDecided, on_event)
        await bus.subscribe(worker_ctl("w1"), EvictModel, on_evict)
        stats = asyncio.create_task(publish_stats())
        try:
            await eventually(lambda: _true(evictions), timeout=20)
            bought = next(e for e in events if isinstance(e, PlanPurchased) and e.bought_bytes)
            (offer,) = [p for p in bought.prices if p.bought]
            assert offer.source == "prewarm" and offer.target == "w1/p" and len(offer.plan_ids) == 1
            decided = next(i for i, e in enumerate(events)
                           if isinstance(e, PlanDecided) and e.plan.plan_id == offer.plan_ids[0])
            assert events.index(bought) < decided  # the purchase first, then what carries it out
            assert evictions[0].model == "p" and evictions[0].plan_id == offer.plan_ids[0]
            await asyncio.sleep(1.0)
            assert len(evictions) == 1  # bought once: by the lease holder, and not again once it was applied

            registry = RegistryClient(bus)
            lease = await registry.get(Bucket.LEASES, "planner")
            assert lease is not None and isinstance(lease.record, LeaseRecord)
            leader = lease.record.holder
            (reply,) = await collect_replies(bus)  # one answer: the holder's
            assert reply.planner_id == leader and reply.economy == "arbiter"
            assert any(p.purchase_id == bought.purchase_id for p in reply.purchases)
            assert reply.purchases == sorted(reply.purchases, key=lambda p: p.ts, reverse=True)

            next(p for p in services.procs if p.instance == leader).stop()  # releases the lease
            other = "planner-b" if leader == "planner-a" else "planner-a"

            async def new_holder() -> list[PurchaseLogReply]:
                replies = await collect_replies(bus, timeout=0.5)
                return replies if replies and replies[0].planner_id == other else []

            (reply,) = await eventually(new_holder, timeout=15)
            assert reply.planner_id == other
        finally:
            stats.cancel()
    finally:
        await bus.close()


async def _true(items: list) -> bool:  # type: ignore[type-arg]
    return bool(items)
