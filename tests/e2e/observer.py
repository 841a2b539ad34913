"""A read-only listener on the cluster's bus: every request's chunks and every worker's stats.

Tests use it to see what the HTTP client cannot: which worker generated which chunk (so a
re-dispatch is visible) and how much KV each instance holds (so freed blocks are visible).
"""
from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

from shared.bus import Bus, BusSettings, Delivery, Subscription
from services.gateway.seq_order import SeqOrder
from shared.events import StreamError, StreamMessage, StreamReassigned, TokenChunk, WorkerStats
from shared.subjects import CATALOG, worker_stats


@dataclass(frozen=True)
class Seen:
    at: float  # local receive time (time.time())
    msg: TokenChunk | StreamError | StreamReassigned


class Observer:
    def __init__(self) -> None:
        self.bus: Bus | None = None
        self.streams: dict[str, list[Seen]] = {}
        self.stats: list[tuple[float, WorkerStats]] = []
        self._subs: list[Subscription] = []

    async def start(self, nats_url: str) -> "Observer":
        self.bus = await Bus.connect(BusSettings(url=nats_url), service="cli")
        out = CATALOG["request.out"].wildcard
        self._subs.append(await self.bus.subscribe(out, StreamMessage, self._on_stream, label=out))
        self._subs.append(await self.bus.subscribe(worker_stats(), WorkerStats, self._on_stats))
        return self

    async def stop(self) -> None:
        if self.bus is not None:
            await self.bus.close()

    async def _on_stream(self, msg: StreamMessage, _ctx: Delivery) -> None:
        self.streams.setdefault(msg.request_id, []).append(Seen(time.time(), msg))

    async def _on_stats(self, msg: WorkerStats, _ctx: Delivery) -> None:
        self.stats.append((time.time(), msg))
        del self.stats[:-2000]

    # --- reading ----------------------------------------------------------------------------
    def chunks(self, request_id: str) -> list[TokenChunk]:
        """The request's chunks as a consumer delivers them (the gateway's order and assignment fence:
        services/gateway/seq_order.py): each seq once, none from a superseded assignment."""
        order, out = SeqOrder(max_held=1 << 20), []
        for seen in self.streams.get(request_id, []):
            out += [m for m in order.push(seen.msg) if isinstance(m, TokenChunk)]  # type: ignore[arg-type]
        return out

    def raw_chunks(self, request_id: str) -> list[TokenChunk]:
        """Every chunk published for the request, stale copies' included, in arrival order."""
        return [s.msg for s in self.streams.get(request_id, []) if isinstance(s.msg, TokenChunk)]

    def workers(self, request_id: str) -> list[str]:
        """The workers that generated the request's chunks, in seq order, without repeats."""
        out: list[str] = []
        for c in sorted(self.chunks(request_id), key=lambda c: c.seq):
            if c.worker_id and (not out or out[-1] != c.worker_id):
                out.append(c.worker_id)
        return out

    def active(self) -> list[str]:
        """Requests with chunks and no final message yet."""
        return [rid for rid, seen in self.streams.items() if seen and not any(s.msg.final for s in seen)]

    def kv_used(self, worker_id: str, since: float = 0.0) -> list[tuple[float, int]]:
        """(worker's stats time, KV blocks used over its instances) for stats received after `since`."""
        return [(s.ts, sum(i.kv_blocks_used for i in s.instances)) for at, s in self.stats
                if s.worker_id == worker_id and at >= since]

    async def wait_for(self, check, timeout: float = 10.0, interval: float = 0.01):  # type: ignore[no-untyped-def]
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            value = check()
            if value:
                return value
            await asyncio.sleep(interval)
        raise AssertionError(f"not seen within {timeout}s")
