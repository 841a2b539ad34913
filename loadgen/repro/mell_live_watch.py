"""`tidal repro mell --live`: what the bus says during a live run — active workers, KV, migrations.

`LiveWatch` keeps every `WorkerStats` (each worker publishes one every 250 ms) and every plan event.
`summarise` (pure) samples the stats on a fixed grid: at each tick, the latest stats of each worker
at or before it; a worker is *active* when it holds at least one request (running or waiting), and
the KV utilisation is the KV its instances use over the KV its pool could hold (the pool's KV plus
its free bytes), over the active workers only. Migrations are the `Migrate` plans decided, by mode,
and how each ended.
"""
from __future__ import annotations

import bisect
from collections import Counter
from dataclasses import dataclass, field

import numpy as np

from loadgen.runner.bus_watch import watch_stats_and_plans
from shared.bus import Bus, Delivery
from shared.events import WorkerStats
from shared.events.plan import Migrate, PlanApplied, PlanCancelled, PlanDecided, PlanEvent, PlanFailed


@dataclass(frozen=True, slots=True)
class WorkerSample:
    ts: float  # the worker's stats time (Unix)
    requests: int  # running + waiting, over its instances
    kv_used_bytes: int
    kv_capacity_bytes: int


def sample_of(msg: WorkerStats) -> WorkerSample:
    used = sum(i.kv_blocks_used * i.kv_block_bytes for i in msg.instances)
    return WorkerSample(ts=msg.ts, requests=sum(i.running + i.waiting for i in msg.instances), kv_used_bytes=used,
                        kv_capacity_bytes=msg.pool.kv_bytes + msg.pool.free_bytes)


@dataclass
class LiveWatch:
    samples: dict[str, list[WorkerSample]] = field(default_factory=dict)  # worker -> in arrival order
    latest: dict[str, WorkerStats] = field(default_factory=dict)  # worker -> its latest stats
    decided: dict[str, Migrate] = field(default_factory=dict)  # plan id -> its migration
    ended: dict[str, str] = field(default_factory=dict)  # plan id -> applied | failed | cancelled
    triggers: Counter[str] = field(default_factory=Counter)  # migrations decided, by trigger
    bus: Bus | None = None

    async def start(self, nats_url: str) -> "LiveWatch":
        self.bus = await watch_stats_and_plans(nats_url, self._on_stats, self._on_plan)
        return self

    async def stop(self) -> None:
        if self.bus is not None:
            await self.bus.close()
            self.bus = None

    async def _on_stats(self, msg: WorkerStats, _ctx: Delivery) -> None:
        self.samples.setdefault(msg.worker_id, []).append(sample_of(msg))
        self.latest[msg.worker_id] = msg

    def reset(self) -> None:
        """Forget what was seen (between phases); the latest stats stay."""
        self.samples.clear()
        self.decided.clear()
        self.ended.clear()
        self.triggers.clear()

    async def _on_plan(self, msg: PlanEvent, _ctx: Delivery) -> None:
        if isinstance(msg, PlanDecided):
            action = msg.plan.actions[0] if msg.plan.actions else None
            if isinstance(action, Migrate):
                self.decided[msg.plan.plan_id] = action
                self.triggers[msg.plan.trigger] += 1
        elif isinstance(msg, (PlanApplied, PlanFailed, PlanCancelled)):
            outcome = {PlanApplied: "applied", PlanFailed: "failed", PlanCancelled: "cancelled"}[type(msg)]
            self.ended.setdefault(msg.plan_id, outcome)

    def migrations(self) -> dict[str, Counter[str]]:
        """outcome (applied / failed / cancelled / open) -> migrations by decided mode."""
        out: dict[str, Counter[str]] = {}
        for plan_id, action in self.decided.items():
            out.setdefault(self.ended.get(plan_id, "open"), Counter())[action.mode] += 1
        return out


@dataclass(frozen=True)
class LiveSide:
    active: np.ndarray  # active workers per tick
    utilisation: np.ndarray  # KV used / KV capacity of the active workers, per tick (nan: none active)
    tick_s: float

    def busy(self) -> np.ndarray:
        return self.active[self.active > 0]

    def mean_utilisation(self) -> float:
        busy = self.utilisation[self.active > 0]
        return float(np.mean(busy)) if len(busy) else 0.0


def summarise(samples: dict[str, list[WorkerSample]], start_ts: float, end_ts: float, tick_s: float) -> LiveSide:
    """Active workers and their KV utilisation every `tick_s` over [start_ts, end_ts] (Unix times)."""
    if tick_s <= 0 or end_ts < start_ts:
        raise ValueError(f"need tick_s > 0 and end_ts >= start_ts, got {tick_s}, [{start_ts}, {end_ts}]")
    ticks = np.arange(start_ts, end_ts + 1e-9, tick_s)
    active = np.zeros(len(ticks), np.int64)
    used = np.zeros(len(ticks), np.float64)
    capacity = np.zeros(len(ticks), np.float64)
    for series in samples.values():
        ordered = sorted(series, key=lambda s: s.ts)
        times = [s.ts for s in ordered]
        for k, t in enumerate(ticks):
            i = bisect.bisect_right(times, t) - 1
            if i < 0 or ordered[i].requests <= 0:
                continue
            active[k] += 1
            used[k] += ordered[i].kv_used_bytes
            capacity[k] += ordered[i].kv_capacity_bytes
    with np.errstate(invalid="ignore", divide="ignore"):
        util = np.where(capacity > 0, used / np.where(capacity > 0, capacity, 1), np.nan)
    return LiveSide(active=active, utilisation=util, tick_s=tick_s)


__all__ = ["LiveSide", "LiveWatch", "WorkerSample", "sample_of", "summarise"]
