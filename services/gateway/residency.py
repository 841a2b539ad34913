"""Where each LoRA adapter is warm, for `/v1/models` (CaraServe residency, docs/caraserve.md).

The gateway follows the workers' stats (`tidal.v1.evt.worker.stats`, every stats interval)
and keeps each worker's latest `adapter_residency` rows. `ResidencyTable` is pure (time is an
argument): a worker not heard from for `stale_s` no longer counts.
"""
from __future__ import annotations

import time

from services.gateway.api_common import AdapterResidencyCard
from shared.actors import Actor
from shared.bus import Delivery
from shared.events import WorkerStats
from shared.subjects import worker_stats

STALE_S = 10.0


class ResidencyTable:
    def __init__(self, stale_s: float = STALE_S) -> None:
        self.stale_s = stale_s
        self._workers: dict[str, tuple[float, WorkerStats]] = {}

    def update(self, stats: WorkerStats, now: float) -> None:
        self._workers[stats.worker_id] = (now, stats)

    def cards(self, now: float) -> dict[str, AdapterResidencyCard]:
        """adapter -> where it is warm, over the workers heard from within `stale_s`."""
        out: dict[str, AdapterResidencyCard] = {}
        for worker_id, (heard, stats) in sorted(self._workers.items()):
            if now - heard > self.stale_s:
                continue
            for row in stats.adapter_residency:
                card = out.setdefault(row.adapter, AdapterResidencyCard())
                getattr(card, row.level).append(worker_id)
                if row.pinned and row.level == "device":
                    card.pinned.append(worker_id)
        return out


class ResidencyWatch(Actor):
    def __init__(self, table: ResidencyTable) -> None:
        super().__init__("gateway-residency")
        self.table = table

    async def on_start(self) -> None:
        await self.bind(worker_stats(), WorkerStats, self._on_stats)

    async def _on_stats(self, msg: WorkerStats, _ctx: Delivery) -> None:
        self.table.update(msg, time.time())


__all__ = ["AdapterResidencyCard", "ResidencyTable", "ResidencyWatch"]
