"""Announce a service process in the registry, keep it alive with heartbeats, deregister it.

    announcer = Announcer(service, heartbeat_interval=1.0)                  # any service
    announcer = Announcer(service, heartbeat_interval=1.0, worker=spec)     # a gpu_worker
    announcer.install()   # adds the actor and the service's drain/stop hooks

At start it writes the process's `ServiceRecord` (and, for a gpu_worker, its `WorkerRecord`
with device and memory capacity) with compare-and-set, retrying until a registry answers.
Then it publishes a heartbeat every `heartbeat_interval` — `ServiceHeartbeat`, or
`WorkerHeartbeat` whose `incarnation` is the process's service id (the registry keeps the
process's ServiceRecord alive from it) — and at once whenever the service's state changes,
so the registry sees `ready` and `draining` without waiting. On a clean stop it deletes the
ServiceRecord; a WorkerRecord stays (the registry marks it dead when heartbeats stop).

A gpu_worker's data-plane address (`WorkerRecord.ucx_address`, how peers reach its UCX
listener) is known only once its plane has started: `set_ucx_address` writes it into the
WorkerRecord at the next heartbeat tick (or with the first registration, if that comes later).
"""
from __future__ import annotations

import asyncio
import re
import secrets
import socket
import os
import time
from typing import Any, Callable, Protocol

from shared.actors import Actor
from shared.config import WorkerSpec
from shared.events.registry import Bucket, CatalogEntry, Record, ServiceHeartbeat, ServiceRecord, WorkerRecord
from shared.events.worker import WorkerHeartbeat, WorkerState
from shared.logging import get_logger
from shared.registry_client import RegistryClient
from shared.service import Service
from shared.subjects import service_heartbeat, worker_heartbeat
from shared.wire import RevisionConflict, TidalError

log = get_logger("tidal.announce")

_UNSAFE = re.compile(r"[^A-Za-z0-9_-]")


def service_id(instance: str) -> str:
    """The catalog key of a process: its instance id made token-safe ('.' in host names)."""
    cleaned = _UNSAFE.sub("-", instance).strip("-_") or "service"
    return cleaned[:64]


def incarnation(service: str) -> str:
    """One process's incarnation: its service id (a restarted process keeps it) and a random part."""
    return f"{service[:51]}-{secrets.token_hex(6)}"


class Catalog(Protocol):
    """What the announcer needs from the catalog (RegistryClient; the registry uses its store)."""

    async def get(self, bucket: Bucket | str, key: str) -> CatalogEntry | None: ...

    async def modify(self, bucket: Bucket | str, key: str, change: Callable[[Any | None], Record | None]) -> CatalogEntry | None: ...

    async def delete(self, bucket: Bucket | str, key: str, expected_revision: int) -> bool: ...


class Announcer(Actor):
    def __init__(self, service: Service, *, heartbeat_interval: float, worker: WorkerSpec | None = None,
                 catalog: Catalog | None = None, deregister_timeout_s: float = 2.0) -> None:
        super().__init__(f"{service.name}-announcer")
        self.service = service
        self.heartbeat_interval = heartbeat_interval
        self.worker = worker
        self.service_id = service_id(service.settings.instance)
        self.incarnation = incarnation(self.service_id)  # this process: a restart is another incarnation
        self.host = socket.gethostname()
        self.started_ts = time.time()
        self.deregister_timeout_s = deregister_timeout_s
        self._catalog = catalog
        self._seq = 0
        self._registered = asyncio.Event()
        self._last_state: str | None = None
        self.ucx_address: str | None = None  # the worker's data-plane listener, once started
        self._written_ucx_address: str | None = None  # what the registry has

    def install(self) -> "Announcer":
        self.service.add_actor(self)
        self.service.on_drain.append(self._on_drain)
        self.service.on_stop.append(self._on_stop)
        return self

    @property
    def catalog(self) -> Catalog:
        if self._catalog is None:
            self._catalog = RegistryClient(self.bus, timeout=min(2.0, self.bus.settings.request_timeout_s))
        return self._catalog

    @property
    def registered(self) -> asyncio.Event:
        return self._registered

    async def on_start(self) -> None:
        self.spawn("announce", self._run)

    # --- records --------------------------------------------------------------------------
    def _worker_state(self) -> WorkerState:
        return {"ready": WorkerState.READY, "draining": WorkerState.DRAINING}.get(self.service.state, WorkerState.STARTING)

    def service_record(self) -> ServiceRecord:
        now = time.time()
        return ServiceRecord(
            service_id=self.service_id, service=self.service.name, host=self.host, pid=os.getpid(),  # type: ignore[arg-type]
            version=self.service.version[:64], state=self.service.state,  # type: ignore[arg-type]
            metrics_port=self.service.metrics_port, started_ts=self.started_ts, last_heartbeat_ts=now,
        )

    def worker_record(self, current: WorkerRecord | None) -> WorkerRecord:
        assert self.worker is not None
        return WorkerRecord(
            worker_id=self.worker.id, device=self.worker.device, host=self.host,
            memory_capacity_bytes=int(self.worker.memory), state=self._worker_state(), incarnation=self.incarnation,
            ucx_address=self.ucx_address, started_ts=self.started_ts, last_heartbeat_ts=time.time(),
            lifecycle=current.lifecycle if current is not None else None,  # the planner's to write (WarmServe)
        )

    def set_ucx_address(self, address: str | None) -> None:
        """Publish the worker's data-plane address (None: it has none) in its WorkerRecord."""
        self.ucx_address = address

    async def register(self) -> None:
        """Write this process's records (compare-and-set; overwrites a previous incarnation's)."""
        await self.catalog.modify(Bucket.SERVICES, self.service_id, lambda _current: self.service_record())
        if self.worker is not None:
            written = self.ucx_address
            await self.catalog.modify(Bucket.WORKERS, self.worker.id, self.worker_record)
            self._written_ucx_address = written
        self._registered.set()
        log.info("announced in the registry", service_id=self.service_id, worker=self.worker.id if self.worker else None)

    # --- heartbeats -----------------------------------------------------------------------
    async def beat(self) -> None:
        self._last_state = self.service.state
        now = time.time()
        if self.worker is not None:
            await self.bus.publish(worker_heartbeat(), WorkerHeartbeat(
                worker_id=self.worker.id, incarnation=self.incarnation, service_id=self.service_id, seq=self._seq, ts=now,
                state=self._worker_state(),
            ))
        else:
            await self.bus.publish(service_heartbeat(), ServiceHeartbeat(
                service_id=self.service_id, service=self.service.name, seq=self._seq, ts=now,  # type: ignore[arg-type]
                state=self.service.state,  # type: ignore[arg-type]
            ))
        self._seq += 1

    async def _run(self) -> None:
        backoff = 0.1
        while not self._registered.is_set():  # the registry may start after us, or be restarting
            try:
                await self.register()
            except (TidalError, OSError) as exc:
                log.info("registry not reachable yet; retrying", error=str(exc), retry_in_s=backoff)
                await asyncio.sleep(backoff)
                backoff = min(2.0, backoff * 2)
        step = min(0.05, self.heartbeat_interval)
        next_beat = 0.0
        beats_since_check = 0
        while True:
            now = time.monotonic()
            if now >= next_beat or self.service.state != self._last_state:
                await self.beat()
                next_beat = now + self.heartbeat_interval
                beats_since_check += 1
                if beats_since_check >= 10:  # a record forgotten while we were away: announce again
                    beats_since_check = 0
                    await self._ensure_registered()
            if self.worker is not None and self.ucx_address != self._written_ucx_address:
                await self._write_ucx_address()
            await asyncio.sleep(step)

    async def _write_ucx_address(self) -> None:
        assert self.worker is not None
        written = self.ucx_address
        try:
            await self.catalog.modify(Bucket.WORKERS, self.worker.id, self.worker_record)
        except (TidalError, OSError) as exc:
            log.warning("data-plane address not written to the registry; retrying", error=str(exc))
            await asyncio.sleep(0.5)
            return
        self._written_ucx_address = written
        log.info("data-plane address published", worker=self.worker.id, ucx_address=written)

    async def _ensure_registered(self) -> None:
        try:
            if await self.catalog.get(Bucket.SERVICES, self.service_id) is None:
                self._registered.clear()
                await self.register()
        except (TidalError, OSError) as exc:
            log.warning("registry check failed", error=str(exc))

    # --- shutdown -------------------------------------------------------------------------
    async def _on_drain(self, _service: Service) -> None:
        try:
            await self.beat()  # state is "draining" now: tell the registry at once
        except Exception as exc:
            log.warning("draining heartbeat not sent", error=repr(exc))

    async def _on_stop(self, _service: Service) -> None:
        """Deregister (delete the ServiceRecord), within a short deadline; best effort."""
        try:
            await asyncio.wait_for(self._deregister(), self.deregister_timeout_s)
        except (asyncio.TimeoutError, TidalError, OSError) as exc:
            log.warning("not deregistered (the registry marks this process dead instead)", error=repr(exc))

    async def _deregister(self) -> None:
        for _ in range(4):
            entry = await self.catalog.get(Bucket.SERVICES, self.service_id)
            if entry is None:
                return
            try:
                await self.catalog.delete(Bucket.SERVICES, self.service_id, entry.revision)
                log.info("deregistered from the registry", service_id=self.service_id)
                return
            except RevisionConflict:
                continue  # a heartbeat write landed in between: read again
