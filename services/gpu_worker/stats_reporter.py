"""The worker's stats out: `WorkerStats` every interval and at once after a change, the metrics they export,
and the pool breakdown `model_ctl` answers with.

Each round first runs the worker's `tick` (requests past their deadline are aborted, warm weights past their
grace period freed), so the stats it then builds already show what that freed. Handed what it needs; it
does not import the worker.
"""
from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import Any

from services.gpu_worker import metrics as worker_metrics
from services.gpu_worker.adapter_metrics import export_residency
from services.gpu_worker.cold_metrics import export_cold_choices
from services.gpu_worker.instance import ModelInstance
from services.gpu_worker.instance_snapshot import InstanceSnapshot
from services.gpu_worker.stats import StatsBuilder, pool_breakdown
from shared.events import WorkerState
from shared.events.worker import PoolBreakdown
from shared.logging import get_logger
from shared.subjects import worker_stats

log = get_logger("tidal.gpu_worker")

WarmSnapshot = Callable[[], list[tuple[str, InstanceSnapshot]]]


class StatsReporter:
    def __init__(self, worker_id: str, device: str, *, interval: float, state: Callable[[], WorkerState],
                 publish: Callable[[str, Any], Awaitable[None]], warm: WarmSnapshot,
                 tick: Callable[[float], None]) -> None:
        self.worker_id, self.device, self.interval = worker_id, device, interval
        self._state, self._publish, self._warm, self._tick = state, publish, warm, tick
        self.builder = StatsBuilder(worker_id, device, [])

    def serve(self, instances: list[ModelInstance], adapter_users: Callable[[], Any]) -> None:
        """The configured instances are up: report them, with the pool's warm weights and adapter users."""
        self.builder = StatsBuilder(self.worker_id, self.device, instances, pool_extra=self._warm,
                                    adapter_users=adapter_users)

    def set_instances(self, instances: list[ModelInstance]) -> None:
        self.builder.instances = instances

    def pool_breakdown(self, instances: list[ModelInstance]) -> PoolBreakdown:
        return pool_breakdown([(i.instance_id, i.snapshot) for i in instances] + self._warm())

    async def publish_now(self) -> None:
        """WorkerStats now (a change dispatchers should see before the next interval)."""
        try:
            await self._publish(worker_stats(), self.builder.build(self._state(), time.time()))
        except Exception as exc:  # the regular stats loop carries it within one interval anyway
            log.warning("stats not published after a change", error=repr(exc))

    async def run(self) -> None:
        subject = worker_stats()
        while True:
            now = time.time()
            self._tick(now)
            stats = self.builder.build(self._state(), now)
            worker_metrics.export_stats(stats)
            export_residency(stats)
            export_cold_choices(self.worker_id, [(i.instance_id, i.engine.cold.costs.counts)
                                                 for i in self.builder.instances])
            await self._publish(subject, stats)
            await asyncio.sleep(self.interval)
