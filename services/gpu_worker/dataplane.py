"""The worker's data plane: started with the worker, its address published, peers resolved.

    plane = WorkerDataPlane(worker_id)
    await plane.start(registry)          # registry: resolves peers' WorkerRecord.ucx_address
    plane.plane                          # the DataPlane, or None (then `plane.unavailable` says why)
    await plane.close()

Without `ucxx` (the `dataplane` extra is not installed) the worker runs as before and KV
migration is refused as `unsupported` with the reason logged once at start-up.

Environment:
* `TIDAL_DATAPLANE_HOST` — the address peers connect to (default 127.0.0.1; in a multi-host
  deployment the host's reachable IP). `TIDAL_DATAPLANE_PORT` — listener port (0: any free).
* `TIDAL_FAULT_CORRUPT_INBOUND_KV=1` — fault injection for tests: flip one byte of the first
  payload chunk of EVERY transfer this worker receives (workers receive only KV migrations
  today), before its checksum is verified, so every KV migration into this worker fails with
  `corrupt` and falls back to token mode. Off by default; never set it in production.
"""
from __future__ import annotations

import asyncio
import importlib
import os
from typing import TYPE_CHECKING, Any

from shared.events.registry import Bucket, WorkerRecord
from shared.logging import get_logger
from shared.registry_client import RegistryClient
from shared.wire import TidalError

if TYPE_CHECKING:  # the transfer package needs the dataplane extra (ucxx, xxhash)
    from services.gpu_worker.transfer.frames import ChunkHeader

log = get_logger("tidal.gpu_worker.dataplane")

FAULT_CORRUPT_INBOUND_KV = "TIDAL_FAULT_CORRUPT_INBOUND_KV"


def corrupt_first_chunk(header: "ChunkHeader", payload: Any) -> None:
    """Chunk hook: flip the middle byte of chunk 0 of each transfer (the receiver's checksum catches it)."""
    if header.index == 0 and payload.shape[0]:
        payload[payload.shape[0] // 2] ^= 0xFF


class WorkerDataPlane:
    def __init__(self, worker_id: str) -> None:
        self.worker_id = worker_id
        self.plane: Any = None  # transfer.DataPlane once started
        self.unavailable: str | None = "the data plane is not started"
        self._registry: RegistryClient | None = None

    @property
    def address(self) -> str | None:
        return self.plane.address if self.plane is not None else None

    async def start(self, registry: RegistryClient) -> None:
        self._registry = registry
        try:
            await asyncio.to_thread(importlib.import_module, "ucxx")  # ~1 s: off the event loop
            from services.gpu_worker.transfer import DataPlane, DataPlaneConfig
        except ImportError as exc:
            self.unavailable = f"ucxx is not installed here ({exc}): install the 'dataplane' extra for KV migration"
            log.warning("KV migration unavailable: no data plane", worker=self.worker_id, reason=self.unavailable)
            return
        config = DataPlaneConfig(host=os.environ.get("TIDAL_DATAPLANE_HOST", "127.0.0.1"),
                                 port=int(os.environ.get("TIDAL_DATAPLANE_PORT", "0")))
        hook = None
        if os.environ.get(FAULT_CORRUPT_INBOUND_KV, "0") not in ("", "0"):
            hook = corrupt_first_chunk
            log.warning("FAULT INJECTION: every inbound transfer's first chunk is corrupted", env=FAULT_CORRUPT_INBOUND_KV)
        try:
            self.plane = await DataPlane(self.worker_id, config=config, resolver=self.resolve, chunk_hook=hook).start()
        except Exception as exc:  # noqa: BLE001 - UCX could not listen: serve without KV migration
            self.unavailable = f"the data plane did not start: {exc!r}"
            log.error("KV migration unavailable", worker=self.worker_id, reason=self.unavailable)
            return
        self.unavailable = None

    async def resolve(self, peer: str) -> str | None:
        """A peer worker's data-plane address, from its WorkerRecord (None: unknown)."""
        if self._registry is None:
            return None
        try:
            entry = await self._registry.get(Bucket.WORKERS, peer)
        except (TidalError, OSError) as exc:
            log.warning("peer address lookup failed", peer=peer, error=str(exc))
            return None
        record = entry.record if entry is not None else None
        return record.ucx_address if isinstance(record, WorkerRecord) else None

    async def close(self) -> None:
        if self.plane is not None:
            plane, self.plane = self.plane, None
            self.unavailable = "the data plane is closed"
            await plane.close()
