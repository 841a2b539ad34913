"""Where incoming transfers land: preallocated destinations by key, or per-kind factories.

A receiver either *expects* a transfer by key with its destination already allocated (a
migration's KV blocks: `inbox.expect(key, buffers)`), or accepts any transfer of a kind
into fresh memory (`inbox.accept_any(kind)`: activations). A transfer nobody expects is
refused with `rejected`, and its bytes are drained and dropped.
"""
from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

from .buffers import Segments, synchronize
from .errors import TransferFailed
from .frames import TransferStart
from .policy import TrafficClass


@dataclass(frozen=True)
class Received:
    """A transfer that arrived complete and verified."""

    key: str
    kind: TrafficClass
    peer: str
    transfer_id: int
    total_bytes: int
    chunks: int
    buffers: Any  # what the destination was given as (or the fresh uint8 array)
    layers: tuple[int, int] | None = None
    request_id: str = ""


class Sink:
    """The destination of one transfer, and the future its receiver awaits."""

    def __init__(self, key: str, buffers: Any) -> None:
        self.key = key
        self.buffers = buffers
        self.segments = Segments.of(buffers)
        synchronize(self.segments.views)  # device memory: no queued kernel touches it while UCX writes
        self._done: asyncio.Future[Received] = asyncio.get_running_loop().create_future()
        self._done.add_done_callback(_consume_exception)

    def complete(self, received: Received) -> None:
        if not self._done.done():
            self._done.set_result(received)

    def fail(self, error: TransferFailed) -> None:
        if not self._done.done():
            self._done.set_exception(error)

    @property
    def done(self) -> bool:
        return self._done.done()

    async def wait(self, timeout: float | None = None) -> Received:
        """The transfer, once every byte is in the destination; raises TransferFailed."""
        if timeout is None:
            return await asyncio.shield(self._done)
        try:
            return await asyncio.wait_for(asyncio.shield(self._done), timeout)
        except asyncio.TimeoutError:
            raise TransferFailed("timeout", f"nothing complete for key {self.key!r} within {timeout}s") from None


def _consume_exception(fut: asyncio.Future[Received]) -> None:
    if not fut.cancelled():
        fut.exception()  # a failure nobody awaited must not be logged as "never retrieved"


SinkFactory = Callable[[TransferStart, str], "Sink | None"]


class Inbox:
    """The receiving side's table of destinations (one per data plane)."""

    def __init__(self) -> None:
        self._expected: dict[str, Sink] = {}
        self._factories: dict[TrafficClass, SinkFactory] = {}

    def expect(self, key: str, buffers: Any) -> Sink:
        """Receive the transfer named `key` straight into `buffers` (tensors/arrays, in order)."""
        if key in self._expected and not self._expected[key].done:
            raise ValueError(f"a transfer with key {key!r} is already expected")
        sink = Sink(key, buffers)
        self._expected[key] = sink
        return sink

    def forget(self, key: str) -> None:
        sink = self._expected.pop(key, None)
        if sink is not None:
            sink.fail(TransferFailed("cancelled", f"no longer expecting {key!r}"))

    def on_kind(self, kind: TrafficClass, factory: SinkFactory) -> None:
        self._factories[kind] = factory

    def accept_any(self, kind: TrafficClass) -> "asyncio.Queue[Received]":
        """Accept every unexpected transfer of `kind` into fresh memory; completed ones are queued."""
        queue: asyncio.Queue[Received] = asyncio.Queue()

        def factory(start: TransferStart, _peer: str) -> Sink:
            sink = Sink(start.key, np.empty(start.total_bytes, dtype=np.uint8))
            sink._done.add_done_callback(lambda f: f.cancelled() or f.exception() or queue.put_nowait(f.result()))
            return sink

        self._factories[kind] = factory
        return queue

    def open(self, start: TransferStart, peer: str) -> Sink | None:
        """The destination for an announced transfer, or None (refuse it)."""
        sink = self._expected.pop(start.key, None)
        if sink is None or sink.done:
            factory = self._factories.get(TrafficClass[start.kind.upper()])
            sink = factory(start, peer) if factory is not None else None
        return sink
