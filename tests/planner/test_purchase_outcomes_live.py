"""How purchases end, live: a real nats-server, a registry process and a planner process with
`economy = "arbiter"`. A worker (this test: its stats and its ctl subject) is above the KV watermark with
requests waiting and two device-resident adapters: `hot` (a request admitted there uses it) and `cold`.
Only `cold` is offered, so only it is ever asked to offload. The worker refuses the first `OffloadAdapter`
`busy` (a request for it arrived after the stats); after one horizon the arbiter buys it again and it is
done. The planner's purchase log counts one refused (busy) and one applied adapter offload, and marks
each on its purchase's price line."""
from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest

from shared.bus import Bus, BusSettings, Delivery
from shared.events.common import LayerRange
from shared.events.ctl import CtlDone, CtlRefused, OffloadAdapter
from shared.events.plan import PurchaseLogReply, PurchaseLogRequest
from shared.events.worker import AdapterResidency, InstanceStats, PoolBreakdown, WorkerState, WorkerStats
from shared.planner.purchase_outcomes import summary
from shared.subjects import planner_purchases, worker_ctl, worker_stats

from service_procs import FAST_LIVENESS, eventually, local_cluster, write_config

pytestmark = pytest.mark.timeout(120)

CONFIG = FAST_LIVENESS + """
[planner]
interval = "300ms"
lease_ttl = "1s"
economy = "arbiter"
cost_profile = "cpu"
horizon = "1s"

[policies]
buddy_groups = false
migration = "off"
prewarm = false
"""
MIB = 1 << 20


def needy_stats(seq: int, cold_resident: bool) -> WorkerStats:
    """w1: 95 of 100 MiB of KV in use, 4 requests waiting; adapters `hot` (1 user) and `cold` (none) on the device."""
    rows = [AdapterResidency(adapter="hot", level="device", rank=8, bytes=4 * MIB, users=1)]
    if cold_resident:
        rows.append(AdapterResidency(adapter="cold", level="device", rank=8, bytes=4 * MIB))
    pool = PoolBreakdown(capacity_bytes=110 * MIB, weights_bytes=2 * MIB, adapter_bytes=4 * MIB * len(rows),
                         kv_bytes=100 * MIB, free_bytes=8 * MIB - 4 * MIB * len(rows))
    inst = InstanceStats(instance_id="w1-m", model="m", layers=LayerRange(start=0, end=4), running=2, waiting=4,
                         queued_prompt_tokens=2000, kv_blocks_total=1600, kv_blocks_used=1520, kv_block_bytes=64 << 10,
                         adapters=["hot", "cold"])
    return WorkerStats(worker_id="w1", seq=seq, ts=time.time(), device="cpu", state=WorkerState.READY, pool=pool,
                       instances=[inst], adapter_residency=rows)


def test_a_refused_then_applied_adapter_offload_is_counted_by_outcome(tmp_path: Path) -> None:
    config = write_config(tmp_path, CONFIG)
    with local_cluster(tmp_path) as services:
        services.start("registry", config, "registry-t")
        services.start("planner", config, "planner-a")
        services.wait_ready(timeout=60)
        asyncio.run(_scenario(services))


async def _scenario(services) -> None:  # type: ignore[no-untyped-def]
    bus = await Bus.connect(BusSettings(url=services.url), service="test")
    asked: list[OffloadAdapter] = []
    cold_resident = True

    async def on_offload(msg: OffloadAdapter, _ctx: Delivery) -> CtlDone | CtlRefused:
        nonlocal cold_resident
        asked.append(msg)
        if len(asked) == 1:
            return CtlRefused(idempotency_key=msg.idempotency_key, command="OffloadAdapter", worker_id="w1",
                              code="busy", message="1 request admitted on w1 uses it")
        cold_resident = False
        return CtlDone(idempotency_key=msg.idempotency_key, command="OffloadAdapter", worker_id="w1")

    async def publish_stats() -> None:
        seq = 0
        while True:
            seq += 1
            await bus.publish(worker_stats(), needy_stats(seq, cold_resident))
            await asyncio.sleep(0.1)

    async def log_with_both() -> PurchaseLogReply | None:
        try:
            reply = await bus.request(planner_purchases(), PurchaseLogRequest(limit=50), PurchaseLogReply, timeout=1.0)
        except Exception:  # no lease holder yet
            return None
        got = {(r.outcome, r.reason): r.count for r in reply.outcomes}
        return reply if ("refused", "busy") in got and ("applied", "") in got else None

    try:
        await bus.subscribe(worker_ctl("w1"), OffloadAdapter, on_offload)
        stats = asyncio.create_task(publish_stats())
        try:
            reply = await eventually(log_with_both, timeout=40)
        finally:
            stats.cancel()
        assert [m.adapter for m in asked] == ["cold", "cold"]  # the adapter in use is never offered
        counts = {(r.source, r.outcome, r.reason): r.count for r in reply.outcomes}
        assert counts == {("adapter", "refused", "busy"): 1, ("adapter", "applied", ""): 1}
        assert reply.in_flight == 0
        assert summary(reply.outcomes).startswith("applied=50% (1 applied, 1 refused: busy 1, 0 failed)")
        marked = [(p.outcome, p.outcome_reason) for purchase in reply.purchases for p in purchase.prices if p.bought]
        assert sorted(marked) == [("applied", ""), ("refused", "busy")]  # each on its purchase's line
    finally:
        await bus.close()
