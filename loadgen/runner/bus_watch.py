"""Optional: while a live run goes on, listen on the cluster's bus for what the HTTP client
cannot see — each worker's memory by kind (`WorkerStats`, every 250 ms) and plan events —
for the report's timeline. Read-only; times are converted to the run's clock.
"""
from __future__ import annotations

import os
from collections.abc import Awaitable, Callable

from loadgen.report.records import MemorySample, PlanMarker
from shared.bus import Bus, BusSettings, Delivery
from shared.events import WorkerStats
from shared.events.plan import PlanApplied, PlanDecided, PlanEvent, PlanFailed
from shared.run_state import RunState
from shared.subjects import CATALOG, worker_stats

_KINDS = ("weights", "prewarm", "adapter", "kv", "workspace")


def find_cluster(data_dir: str | os.PathLike[str] | None = None) -> tuple[RunState | None, str]:
    """The running `tidal up` cluster's state, found as `tidal status` finds it (shared/run_locate.py;
    `data_dir` is --state), or None; and where it was found, or where it looked."""
    from shared.config import ConfigError, load_config
    from shared.run_locate import STATE_ENV, locate
    from shared.run_state import read_state

    config_dir = None
    if not data_dir and not os.environ.get(STATE_ENV):
        try:
            config_dir = load_config().cluster.data_dir
        except ConfigError:
            config_dir = None
    located = locate(data_dir, config_dir)
    if located.data_dir is None:
        return None, located.why_none()
    try:
        state = read_state(located.data_dir)
    except (ValueError, OSError) as exc:
        return None, str(exc)
    if state is None:
        return None, f"no Tidal cluster is running from {located.data_dir}"
    return state, f"the cluster of {located.data_dir}"


def find_nats(data_dir: str | os.PathLike[str] | None = None) -> tuple[str | None, str]:
    """The NATS url of the running cluster (see `find_cluster`), or None and where it looked."""
    state, where = find_cluster(data_dir)
    return (state.nats_url if state is not None else None), where


async def watch_stats_and_plans(nats_url: str, on_stats: Callable[[WorkerStats, Delivery], Awaitable[None]],
                                on_plan: Callable[[PlanEvent, Delivery], Awaitable[None]]) -> Bus:
    """A read-only bus connection (as the cli) handing every worker's stats and every plan event to the two
    callbacks: what each live run's watcher (this one, `tidal repro mell/warmserve --live`) listens to."""
    bus = await Bus.connect(BusSettings(url=nats_url, initial_connect_s=3.0), service="cli")
    await bus.subscribe(worker_stats(), WorkerStats, on_stats)
    await bus.subscribe(CATALOG["plan.event"].wildcard, PlanEvent, on_plan)
    return bus


class BusWatch:
    def __init__(self, t0_unix: float = 0.0) -> None:
        self.t0_unix = t0_unix  # set to the run's start before the run
        self.memory: list[MemorySample] = []
        self.plans: list[PlanMarker] = []
        self.bus: Bus | None = None

    async def start(self, nats_url: str) -> "BusWatch":
        self.bus = await watch_stats_and_plans(nats_url, self._on_stats, self._on_plan)
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


__all__ = ["BusWatch", "find_cluster", "find_nats"]
