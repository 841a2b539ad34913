"""The worker's own view of its link to the bus, so a partition is noticed on the worker's side too.

Every `interval_s` the worker makes a PING/PONG round trip to its NATS server (`flush`). The
heartbeats that keep it alive in everyone else's eyes travel the same connection, so when no
round trip has completed for `fence_after_s` (the registry's `dead_after` plus a margin) the
rest of the cluster has declared this worker dead and re-dispatched its requests. The worker
then fences itself (`on_fenced`): it stops generating, drops its assignments and comes back as
a new incarnation (peers treat it as restarted: what it held is not trusted). The gap is
measured from the last completed round trip *before* the next one is tried, so a process that
was paused (SIGSTOP, a VM stall) fences itself on resuming even though its link is fine.

Pure apart from the injected `flush` and `clock`; the loop is `run()`.
"""
from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable

from shared.logging import get_logger

log = get_logger("tidal.gpu_worker.bus_watch")

DEFAULT_INTERVAL_S = 0.5
MARGIN_S = 1.0  # past dead_after: the cluster's verdict (a tick of the dispatcher, the registry) is in


class BusWatch:
    def __init__(self, flush: Callable[[float], Awaitable[None]], on_fenced: Callable[[float], None], *,
                 fence_after_s: Callable[[], float], interval_s: float = DEFAULT_INTERVAL_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.flush = flush  # one PING/PONG round trip, raising on a timeout or a lost connection
        self.on_fenced = on_fenced
        self.fence_after_s = fence_after_s
        self.interval_s = interval_s
        self.clock = clock
        self.last_ack = clock()
        self.fenced = False  # in the current outage (cleared by the next completed round trip)
        self.fences = 0

    def check(self) -> bool:
        """Fence if the last completed round trip is too old; True when it fenced now."""
        silent = self.clock() - self.last_ack
        if silent < self.fence_after_s() or self.fenced:
            return False
        self.fenced = True
        self.fences += 1
        log.warning("lost the bus longer than the cluster waits for a worker; fencing this worker",
                    silent_s=round(silent, 2), fence_after_s=self.fence_after_s())
        self.on_fenced(silent)
        return True

    def acked(self) -> None:
        self.last_ack = self.clock()
        self.fenced = False

    async def tick(self) -> None:
        self.check()
        try:
            await self.flush(max(self.interval_s, 1.0))
        except Exception:  # timed out, disconnected, reconnecting: the gap grows
            return
        self.check()  # a round trip that took a long time (a stall while it waited) counts as a gap too
        self.acked()

    async def run(self) -> None:
        while True:
            await self.tick()
            await asyncio.sleep(self.interval_s)


def fence_after(dead_after_s: float) -> float:
    return dead_after_s + MARGIN_S


__all__ = ["BusWatch", "fence_after"]
