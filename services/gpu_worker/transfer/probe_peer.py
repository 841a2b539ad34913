"""A data-plane peer process for tests and benchmarks: accepts every transfer, reports it.

    python -m services.gpu_worker.transfer.probe_peer --id peer-b [--corrupt-chunk N] [--exit-after-chunks N]

Prints one JSON line per event on stdout: first `ready` (its address), then `received`
(key, bytes, chunks, sha256 of the bytes in order) or `failed` (key, reason) per transfer.
Incoming transfers land in fresh buffers laid out like the sender's segments, so chunks
that span segments exercise the scatter path. Fault injection (receiver side):
`--corrupt-chunk N` flips one byte of the N-th payload chunk received (0-based) before it is
verified; `--exit-after-chunks N` kills the process (no goodbye) after N payload chunks.
The process exits when its stdin closes, so it never outlives the test that started it.
"""
from __future__ import annotations

import argparse
import asyncio
import hashlib
import os
import sys
import threading
from typing import Literal

import msgspec
import numpy as np

from shared.logging import configure_logging

from .frames import ChunkHeader, TransferStart
from .plane import DataPlane, DataPlaneConfig
from .policy import TrafficClass
from .sink import Sink


class PeerEvent(msgspec.Struct, kw_only=True, frozen=True):
    event: Literal["ready", "received", "failed"]
    address: str = ""
    key: str = ""
    kind: str = ""
    nbytes: int = 0
    chunks: int = 0
    sha256: str = ""
    reason: str = ""


def _emit(event: PeerEvent) -> None:
    sys.stdout.write(msgspec.json.encode(event).decode() + "\n")
    sys.stdout.flush()


class _Faults:
    def __init__(self, corrupt_chunk: int | None, exit_after: int | None) -> None:
        self.corrupt_chunk, self.exit_after, self.seen = corrupt_chunk, exit_after, 0

    def __call__(self, header: ChunkHeader, payload: np.ndarray) -> None:
        if self.corrupt_chunk is not None and self.seen == self.corrupt_chunk and payload.shape[0]:
            payload[payload.shape[0] // 2] ^= 0xFF
        self.seen += 1
        if self.exit_after is not None and self.seen >= self.exit_after:
            os._exit(9)  # die mid-transfer, like a crashed worker


def _factory(start: TransferStart, _peer: str) -> Sink:
    sizes = start.segments if sum(start.segments) == start.total_bytes else [start.total_bytes]
    sink = Sink(start.key, [np.empty(n, dtype=np.uint8) for n in sizes])

    def report(fut: asyncio.Future) -> None:  # type: ignore[type-arg]
        if fut.cancelled():
            return
        error = fut.exception()
        if error is not None:
            _emit(PeerEvent(event="failed", key=start.key, kind=start.kind, reason=getattr(error, "reason", "?")))
            return
        digest = hashlib.sha256()
        for buf in sink.buffers:
            digest.update(buf)
        _emit(PeerEvent(event="received", key=start.key, kind=start.kind, nbytes=start.total_bytes,
                        chunks=fut.result().chunks, sha256=digest.hexdigest()))

    sink._done.add_done_callback(report)
    return sink


async def serve(peer_id: str, faults: _Faults) -> None:
    plane = DataPlane(peer_id, config=DataPlaneConfig(), chunk_hook=faults)
    for kind in TrafficClass:
        plane.inbox.on_kind(kind, _factory)
    await plane.start()
    _emit(PeerEvent(event="ready", address=plane.address))
    await asyncio.Event().wait()


def _exit_when_stdin_closes() -> None:
    sys.stdin.read()
    os._exit(0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--id", default="probe-peer")
    parser.add_argument("--corrupt-chunk", type=int, default=None)
    parser.add_argument("--exit-after-chunks", type=int, default=None)
    args = parser.parse_args()
    configure_logging("probe-peer", level=os.environ.get("TIDAL_LOG_LEVEL", "warning"))  # stderr: stdout is for events
    threading.Thread(target=_exit_when_stdin_closes, daemon=True).start()
    asyncio.run(serve(args.id, _Faults(args.corrupt_chunk, args.exit_after_chunks)))


if __name__ == "__main__":
    main()
