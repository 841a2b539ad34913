"""What the dispatchers' latest stats say the planner's view needs: queues and adapter arrival rates.

A dispatcher silent for longer than `max(max_age_s, 3 stats intervals)` counts for nothing (it died or
lost its connection; its queue is someone else's now or gone).
"""
from __future__ import annotations

from collections.abc import Iterable

from shared.events.dispatch import DispatchStats


class DispatcherDemand:
    def __init__(self, latest: Iterable[DispatchStats], now: float, *, max_age_s: float) -> None:
        self.fresh = [m for m in latest if now - m.ts <= max(max_age_s, 3 * m.interval_s)]

    def queued(self) -> dict[str, int]:
        """Requests the dispatchers hold in their admission queues, by base model (no instance had room)."""
        out: dict[str, int] = {}
        for msg in self.fresh:
            for load in msg.models:
                if load.adapter is None and load.queued:
                    out[load.model] = out.get(load.model, 0) + load.queued
        return out

    def adapter_rps(self) -> dict[str, float]:
        """Arrivals per second of each LoRA adapter over the dispatchers' latest intervals: the arbiter
        prices evicting a resident adapter by how soon it is used again."""
        out: dict[str, float] = {}
        for msg in self.fresh:
            for load in msg.models:
                if load.adapter is not None and load.arrivals:
                    out[load.adapter] = out.get(load.adapter, 0.0) + load.arrivals / msg.interval_s
        return out


__all__ = ["DispatcherDemand"]
