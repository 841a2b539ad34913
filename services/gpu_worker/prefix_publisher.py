"""Each instance's prefix-cache summary on `tidal.v1.evt.worker.prefixes` (`PrefixSummary`).

For prefix-aware routing (the dispatcher's services/dispatcher/prefix_index.py, or an external
scheduler on the same subject): every `interval` the publisher reads each instance's
`engine.prefix_cache` (the engine's PrefixCache; None when caching is off: nothing is sent) —
the block hashes it holds, most recently used first, capped at MAX_PREFIX_HASHES, and its hit
counters — and sends a summary when the reading changed, at most once per `interval`, and an
unchanged one at least every `max_silence`, so a reader knows it is fresh. The cache's reading
methods take its own lock, so they are called from the event loop, not the engine thread.

`read`, `due` and `summary` are pure given their inputs; `PrefixPublisher.run` is the loop.
"""
from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any

from shared.events import PrefixSummary
from shared.events.worker import MAX_PREFIX_HASHES
from shared.logging import get_logger

log = get_logger("tidal.gpu_worker.prefixes")

INTERVAL_S = 0.25  # at most one summary per instance this often (a stats interval)
MAX_SILENCE_S = 2.0  # an unchanged summary is sent again this often (the dispatcher drops one 10 s old)


@dataclass(frozen=True, slots=True)
class Reading:
    """One read of an instance's prefix cache."""

    block_size: int
    hashes: tuple[int, ...]  # most recently used first, at most the cap
    held: int  # all the hashes it holds
    cached_free: int
    queried: int
    hits: int


@dataclass(frozen=True, slots=True)
class Sent:
    reading: Reading
    at: float
    seq: int


def read(cache: Any, cap: int = MAX_PREFIX_HASHES) -> Reading:
    """The cache's state through the agreed interface (held_hashes, hit_stats, cached_free_blocks);
    a cache that is not `enabled` (e.g. a buddy-group stage holding a layer subset) holds nothing."""
    held = cache.held_hashes() if getattr(cache, "enabled", True) else []
    queried, hits = cache.hit_stats()
    return Reading(block_size=int(cache.block_size), hashes=tuple(held[:cap]), held=len(held),
                   cached_free=int(cache.cached_free_blocks()), queried=int(queried), hits=int(hits))


def due(last: Sent | None, reading: Reading, now: float, *, interval: float = INTERVAL_S,
        max_silence: float = MAX_SILENCE_S) -> bool:
    """Send now? The first reading, a changed one once `interval` passed, any after `max_silence`."""
    if last is None:
        return True
    age = now - last.at
    if age < interval:
        return False
    return reading != last.reading or age >= max_silence


def summary(worker_id: str, instance_id: str, model: str, seq: int, now: float, r: Reading) -> PrefixSummary:
    return PrefixSummary(worker_id=worker_id, instance_id=instance_id, model=model, seq=seq, ts=now,
                         block_size=r.block_size, hashes=list(r.hashes), held_blocks=r.held,
                         cached_free_blocks=r.cached_free, queried_blocks=r.queried, hit_blocks=r.hits)


class PrefixPublisher:
    def __init__(self, worker_id: str, instances: Mapping[str, Any],
                 publish: Callable[[PrefixSummary], Awaitable[None]], *, interval: float = INTERVAL_S,
                 max_silence: float = MAX_SILENCE_S, clock: Callable[[], float] = time.time) -> None:
        self.worker_id = worker_id
        self.instances = instances  # instance id -> ModelInstance (the worker's live dict)
        self.publish = publish
        self.interval = interval
        self.max_silence = max_silence
        self.clock = clock
        self.sent: dict[str, Sent] = {}
        self._seq: dict[str, int] = {}

    async def tick(self) -> int:
        """Read every instance once and send what is due; how many summaries went out."""
        now, out = self.clock(), 0
        for iid in [i for i in self.sent if i not in self.instances]:
            del self.sent[iid]  # evicted: its seq is kept, a reloaded instance of that id goes on from it
        for iid, inst in list(self.instances.items()):
            cache = getattr(getattr(inst, "engine", None), "prefix_cache", None)
            if cache is None:
                continue
            reading = read(cache)
            if not due(self.sent.get(iid), reading, now, interval=self.interval, max_silence=self.max_silence):
                continue
            seq = self._seq.get(iid, -1) + 1
            await self.publish(summary(self.worker_id, iid, inst.model, seq, now, reading))
            self._seq[iid] = seq
            self.sent[iid] = Sent(reading, now, seq)
            out += 1
        return out

    async def run(self) -> None:
        while True:
            try:
                await self.tick()
            except Exception as exc:  # NATS away, or an instance going: the next tick tries again
                log.warning("prefix summary not published", error=repr(exc))
            await asyncio.sleep(self.interval)


__all__ = ["INTERVAL_S", "MAX_SILENCE_S", "PrefixPublisher", "Reading", "Sent", "due", "read", "summary"]
