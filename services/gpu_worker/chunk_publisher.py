"""Token chunks from the engine threads to NATS, in order, with no per-token work on the event loop.

Each engine step's encoded chunks arrive from its engine thread in one call (`emitted`, the
instances' `Emit`); one task on the event loop (`run`) publishes them in the order they came.
A request whose final chunk went out is reported to `finished` (the worker's active table).
"""
from __future__ import annotations

import asyncio
import collections
import threading
from collections.abc import Callable

import nats.errors
from nats.aio.client import Client as NatsClient
from prometheus_client import Counter

from services.gpu_worker.stream import Payload
from shared.logging import get_logger
from shared.metrics import REGISTRY

log = get_logger("tidal.gpu_worker")

CHUNKS = Counter("tidal_worker_chunks_total", "Token chunks published", registry=REGISTRY)
DROPPED = Counter("tidal_worker_chunks_dropped_total", "Token chunks NATS did not take", registry=REGISTRY)


class ChunkPublisher:
    def __init__(self, finished: Callable[[str], None]) -> None:
        self._finished = finished
        self._outbox: collections.deque[tuple[list[Payload], list[str], threading.Event | None]] = collections.deque()
        self._ready = asyncio.Event()
        self._loop: asyncio.AbstractEventLoop | None = None

    def bind(self, loop: asyncio.AbstractEventLoop) -> None:
        """The event loop `run` publishes on (before any engine thread starts)."""
        self._loop = loop

    def emitted(self, payloads: list[Payload], ended: list[str], sent: threading.Event | None = None) -> None:
        """Called on an engine thread once per step; `sent` is set once these are published."""
        assert self._loop is not None
        try:
            self._loop.call_soon_threadsafe(self._enqueue, payloads, ended, sent)
        except RuntimeError:  # the loop is closed: the process is exiting
            pass

    def _enqueue(self, payloads: list[Payload], ended: list[str], sent: threading.Event | None = None) -> None:
        self._outbox.append((payloads, ended, sent))
        self._ready.set()

    async def run(self, nc: NatsClient) -> None:
        while True:
            await self._ready.wait()
            self._ready.clear()
            while self._outbox:
                payloads, ended, sent = self._outbox.popleft()
                try:
                    for subject, data in payloads:
                        await nc.publish(subject, data)
                except nats.errors.Error as exc:  # NATS away and the reconnect buffer full: these are lost
                    DROPPED.inc(len(payloads))
                    log.warning("chunks not published", error=repr(exc), chunks=len(payloads))
                else:
                    CHUNKS.inc(len(payloads))
                for request_id in ended:
                    self._finished(request_id)
                if sent is not None:  # after nats-py's flusher (woken by the publish) has written them
                    asyncio.get_running_loop().call_soon(sent.set)
