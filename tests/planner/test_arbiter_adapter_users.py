"""Adapter offloads are offered only for adapters nobody admitted on the worker uses (issue 32, item 4):
the worker's stats carry each device-resident adapter's `users` (requests admitted there naming it), the
view drops adapters with users, and the arbiter offers only the idle ones — as the simulator does. A
worker refuses `OffloadAdapter` `busy` while a request uses the adapter, so offering it buys nothing."""
from __future__ import annotations

import sys
from dataclasses import replace
from pathlib import Path

import msgspec

from shared.events import PoolBreakdown, WorkerState, WorkerStats
from shared.events.plan import ReleaseAdapter
from shared.events.worker import AdapterResidency
from shared.planner import PlannerCore
from shared.planner.effects import action_of
from shared.planner.view import AdapterView, evictable_adapters, worker_view

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from arbiter_views import LIKELY, MIB, arbiter, cluster, needy_w1  # noqa: E402


def stats(*rows: AdapterResidency) -> WorkerStats:
    return WorkerStats(worker_id="w1", seq=0, ts=1.0, device="cpu", state=WorkerState.READY,
                       pool=PoolBreakdown(capacity_bytes=1 << 30), adapter_residency=list(rows))


def test_the_view_keeps_only_device_adapters_nobody_uses() -> None:
    rows = [AdapterResidency(adapter="idle", level="device", bytes=64 * MIB),
            AdapterResidency(adapter="idle", level="host", bytes=64 * MIB),
            AdapterResidency(adapter="hot", level="device", bytes=64 * MIB, users=2),
            AdapterResidency(adapter="pinned", level="device", pinned=True, bytes=64 * MIB)]
    assert evictable_adapters(stats(*rows)) == (AdapterView("idle", 64 * MIB, host_copy=True),)
    assert worker_view(stats(*rows)).adapters == (AdapterView("idle", 64 * MIB, host_copy=True),)


def test_stats_from_a_worker_without_users_decode_with_none() -> None:
    old = {"adapter": "a", "level": "device", "bytes": 1024}  # what a worker before `users` sends
    row = msgspec.json.decode(msgspec.json.encode(old), type=AdapterResidency)
    assert row.users == 0
    assert evictable_adapters(stats(row)) == (AdapterView("a", 1024, host_copy=False),)


def test_the_arbiter_offers_and_buys_the_idle_adapter_never_the_busy_one() -> None:
    rows = [AdapterResidency(adapter="busy", level="device", bytes=64 * MIB, users=1),
            AdapterResidency(adapter="idle", level="device", bytes=64 * MIB)]
    w1 = replace(needy_w1(waiting=16, prewarmed={}), adapters=worker_view(stats(*rows)).adapters)
    # neither is asked for at the dispatchers: both would be free to offload, the busy one is not offered
    view = cluster(p_forecast=LIKELY, w1=w1, adapter_rps={"busy": 0.0, "idle": 0.0})
    arb = arbiter()
    effects = PlannerCore([arb], id_prefix="c").step(view)
    (purchase,) = arb.take_purchases(effects)
    offered = {p.target: p.bought for p in purchase.prices if p.source == "adapter"}
    assert offered == {"w1/idle": True}
    assert ReleaseAdapter(worker_id="w1", adapter="idle") in [action_of(e) for e in effects]
    assert all(getattr(action_of(e), "adapter", None) != "busy" for e in effects)
