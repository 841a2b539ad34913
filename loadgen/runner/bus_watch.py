"""Optional: while a live run goes on, listen on the cluster's bus for what the HTTP client
cannot see — each worker's memory by kind (`WorkerStats`, every 250 ms) and plan events —
for the report's timeline. Read-only; times are converted to the run's clock.
"""
from __future__ import annotations

import os
from pathlib import Path

from loadgen.report.records import MemorySample, PlanMarker
from shared.bus import Bus, BusSettings, Delivery
from shared.events import WorkerStats
from shared.events.plan import PlanApplied, PlanDecided, PlanEvent, PlanFailed
from shared.subjects import CATALOG, worker_stats

_KINDS = ("weights", "prewarm", "adapter", "kv", "workspace")


def local_nats_url(data_dir: str | os.PathLike[str] = ".tidal") -> str | None:
    """The NATS url of a cluster `tidal up` runs from `data_dir`, if its state file says one runs."""
    from shared.run_state import read_state

    try:
        state = read_state(Path(data_dir))
    except (ValueError, OSError):
        return None
    return state.nats_url if state is not None else None


class BusWatch:
    def __init__(self, t0_unix: float = 0.0) -> None:
        self.t0_unix = t0_unix  # set to the run's start before the run
        self.memory: list[MemorySample] = []
        self.plans: list[PlanMarker] = []
        self.bus: Bus | None = None

    async def start(self, nats_url: str) -> "BusWatch":
        self.bus = await Bus.connect(BusSettings(url=nats_url, initial_connect_s=3.0), service="cli")
        await self.bus.subscribe(worker_stats(), WorkerStats, self._on_stats)
        await self.bus.subscribe(CATALOG["plan.event"].wildcard, PlanEvent, self._on_plan)
        return self

    async def stop(self) -> None:
        if self.bus is not None:
            await self.bus.close()
            self.bus = None

    async def _on_stats(self, msg: WorkerStats, _ctx: Delivery) -> None:
        t = msg.ts - self.t0_unix
        pool = msg.pool
        for kind in _KINDS:
            self.memory.append(MemorySample(t_s=t, worker=msg.worker_id, kind=kind,
                                            bytes=int(getattr(pool, f"{kind}_bytes"))))

    async def _on_plan(self, msg: PlanEvent, _ctx: Delivery) -> None:
        if isinstance(msg, PlanDecided):
            self.plans.append(PlanMarker(t_s=msg.plan.ts - self.t0_unix, label=f"plan {msg.plan.plan_id} decided"))
        elif isinstance(msg, PlanApplied):
            self.plans.append(PlanMarker(t_s=msg.ts - self.t0_unix, label=f"plan {msg.plan_id} applied"))
        else:  # PlanFailed or PlanCancelled
            ended = "failed" if isinstance(msg, PlanFailed) else "cancelled"
            self.plans.append(PlanMarker(t_s=msg.ts - self.t0_unix, label=f"plan {msg.plan_id} {ended}"))

    def window(self, end_s: float) -> tuple[list[MemorySample], list[PlanMarker]]:
        """Samples and markers inside the run, [0, end_s]."""
        return ([m for m in self.memory if 0 <= m.t_s <= end_s], [p for p in self.plans if 0 <= p.t_s <= end_s])


__all__ = ["BusWatch", "local_nats_url"]
