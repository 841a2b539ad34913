"""LoRA adapters registered, removed and offloaded at runtime: the worker's `LoadAdapter` /
`EvictAdapter` / `OffloadAdapter`.

* `LoadAdapter(adapter, base, path)`: the PEFT directory is read and checked off the event loop
  (once per instance of `base`: each engine keeps the layers it holds), then installed on the
  instance's engine thread between two steps. From then on the instance takes assignments
  naming it; a `WorkerStats` listing it goes out at once (before the reply, so a dispatcher
  knows the adapter is routable here by the time the gateway answers its client) and the
  instance's registry record names it.
* At start, `adopt_catalog_adapters` registers the adapters of the catalog (loaded at runtime
  before this worker started) whose base model it serves: workers that join later serve them too.
* `EvictAdapter(adapter)`: drain, then evict. Assignments naming it are refused at once (stats
  published at once); requests already running with it finish normally, and the adapter leaves
  the engine (its device bytes go back to the pool) when the last of them ends. The reply does
  not wait for that drain. vLLM's unload likewise never cuts a running request.
* `OffloadAdapter(adapter)`: the memory economy's "evict a cold adapter" (the planner's
  `ReleaseAdapter`). Only the device copy goes (`LoRAManager.offload`, on each instance's engine
  thread: its bytes go back to the pool); the adapter stays registered, its host copy stays, and
  the next request naming it loads it again (a cold start; CPU-assisted with `cpu_lora_assist`).
  Refused `busy` while a request admitted here names it (checked again on the engine thread,
  against the engine's queue), `invalid` if pinned, `not_found` if not registered; "not resident"
  when it has no device copy. Stats go out at once (the freed bytes, `adapter_residency`), and
  the reply's detail gives the device bytes freed.

Replies can take a while (a large adapter is read from disk), so each command runs in a task of
its own and answers with `bus.respond`: the worker's mailbox goes on with assignments and
aborts meanwhile. Idempotent per key: a retry gets the first outcome with `replayed=True`
(waiting for it while it runs); a key reused for another command is refused `conflict`. One
command per adapter at a time: another one meanwhile is refused `busy` (retry later).
"""
from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from pathlib import Path
from typing import TYPE_CHECKING, Any

import msgspec

from services.gpu_worker.ctl_idempotency import IdempotentCommands
from services.gpu_worker.engine.engine import LLMEngine
from services.gpu_worker.engine.lora import AdapterPinnedError, LoRAAdapter, load_adapter
from services.gpu_worker.instance import ModelInstance
from services.gpu_worker.instance_snapshot import take_snapshot
from shared.bus import Delivery
from shared.events import AdapterRecord, Bucket, InstanceRecord
from shared.events.ctl import (
    CtlDone, CtlRefused, CtlRefusedCode, CtlReply, EvictAdapter, LoadAdapter, OffloadAdapter,
)
from shared.logging import get_logger
from shared.wire import TidalError

if TYPE_CHECKING:
    from services.gpu_worker.worker_context import WorkerContext

log = get_logger("tidal.gpu_worker.adapters")

AdapterCommand = LoadAdapter | EvictAdapter | OffloadAdapter
DRAIN_POLL_S = 0.05
REGISTRY_TIMEOUT_S = 2.0
MAX_DETAIL = 1000  # characters of an error kept in a reply (Reason allows 2048)


def _install(engine: LLMEngine, adapter: LoRAAdapter, path: str, pinned: bool) -> None:
    """On the engine thread: `LoRAManager.register` without the read (done off the thread); a
    pinned adapter is made device-resident now (MemoryError if it cannot be)."""
    engine.runner.lora.install(adapter, path, pinned=pinned)
    if engine.prefix_cache is not None:  # the name may now stand for other weights: its cached KV is stale
        engine.prefix_cache.invalidate(adapter.name, everything=False)


class AdapterInUse(Exception):
    """`_offload_on_engine`: a request in the engine names the adapter."""


def _offload_on_engine(inst: ModelInstance, name: str) -> int:
    """On the engine thread: drop `name`'s device copy unless a request in the engine (running or
    waiting) names it; returns the bytes freed. The instance's snapshot is taken again here, so
    the stats published right after the reply show the freed bytes (not the last step's view)."""
    engine = inst.engine
    users = [s for s in (*engine.scheduler.running, *engine.scheduler.waiting) if s.adapter == name]
    if users:
        raise AdapterInUse(f"{len(users)} requests in the engine of {inst.instance_id} use adapter {name!r}")
    loads = engine.cold.loads
    if loads is not None and loads.loading(name):  # reserved, on its way: it would land after the offload
        raise AdapterInUse(f"a copy of adapter {name!r} to the device of {inst.instance_id} is in flight")
    freed = engine.runner.lora.offload(name)
    inst.snapshot = take_snapshot(engine, tokens_emitted=inst.encoder.tokens_emitted, steps=inst.snapshot.steps)
    return freed


class AdapterControl:
    def __init__(self, worker: "WorkerContext") -> None:
        self.worker = worker  # what it needs of the worker (services/gpu_worker/worker_context.py)
        self.loading: set[str] = set()
        self.evicting: set[str] = set()  # refusing new requests; removed once its running ones end
        self.offloading: set[str] = set()  # its device copy being dropped
        self._tasks: set[asyncio.Task[None]] = set()
        self.commands: IdempotentCommands[AdapterCommand] = IdempotentCommands(
            run=self._run, refused=self._refused, spawn=self._spawn, failed_message="adapter command failed")

    # --- the handler (called from GpuWorker.on_ctl, in the worker's mailbox) ----------------------
    async def handle(self, msg: AdapterCommand, ctx: Delivery) -> CtlReply | None:
        return self.commands.handle(msg, ctx, self.worker.bus)  # may answer later, from its own task

    def _spawn(self, work: Coroutine[Any, Any, None]) -> None:
        task = asyncio.ensure_future(work)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _run(self, msg: AdapterCommand) -> CtlReply:
        try:
            if isinstance(msg, LoadAdapter):
                return await self._load(msg)
            if isinstance(msg, OffloadAdapter):
                return await self._offload(msg)
            return await self._evict(msg)
        except Exception:
            log.exception("adapter command failed", command=type(msg).__name__, adapter=msg.adapter)
            raise

    # --- load -------------------------------------------------------------------------------------
    async def _load(self, msg: LoadAdapter) -> CtlReply:
        name, worker = msg.adapter, self.worker
        instances = [inst for inst in worker.instances.values() if inst.model == msg.base]
        if not instances:
            return self._refused(msg, "not_found", f"worker {worker.worker_id} serves no instance of {msg.base!r}")
        if worker.draining:
            return self._refused(msg, "busy", f"worker {worker.worker_id} is draining")
        if name in self.loading or name in self.evicting or name in self.offloading:
            return self._refused(msg, "busy", f"adapter {name!r} is being loaded, evicted or offloaded here; "
                                              "retry later")
        running = self._users(name)
        if running:  # a re-load would change the weights under them
            return self._refused(msg, "busy", f"{len(running)} running requests use adapter {name!r}; retry later")
        self.loading.add(name)
        try:
            path = msg.path or await self._catalog_path(name)
            if path is None:
                return self._refused(msg, "not_found", f"adapter {name!r}: no path given and no catalog record")
            for inst in instances:
                lora = inst.engine.runner.lora
                try:
                    adapter = await asyncio.to_thread(load_adapter, Path(path), name, lora.cfg, lora.layers)
                except Exception as exc:  # CheckpointError, OSError, bad JSON, a safetensors error, ...
                    return self._refused(msg, "invalid", f"adapter {name!r} from {path}: {exc}"[:MAX_DETAIL])
                try:
                    await inst.run_on_engine(lambda engine, a=adapter: _install(engine, a, path, msg.pinned))
                except MemoryError as exc:  # pinned with no device room, or the host repository is full
                    inst.adapters = inst.adapters - {name}  # a failed re-load left it unregistered there
                    return self._refused(msg, "insufficient_memory", f"adapter {name!r}: {exc}"[:MAX_DETAIL])
                inst.adapters = inst.adapters | {name}
                rank = adapter.rank
        finally:
            self.loading.discard(name)
        await self._changed(instances)
        log.info("LoRA adapter loaded", adapter=name, base=msg.base, path=path, rank=rank, pinned=msg.pinned,
                 instances=[i.instance_id for i in instances])
        return self._done(msg, f"adapter {name!r} (rank {rank}{', pinned' if msg.pinned else ''}) registered on "
                               f"{', '.join(i.instance_id for i in instances)}")

    async def _catalog_path(self, name: str) -> str | None:
        catalog = self.worker.catalog
        if catalog is None:
            return None
        try:
            entry = await asyncio.wait_for(catalog.registry.get(Bucket.ADAPTERS, name), REGISTRY_TIMEOUT_S)
        except (asyncio.TimeoutError, TidalError, OSError):
            return None
        record = entry.record if entry is not None else None
        return record.path if isinstance(record, AdapterRecord) else None

    async def adopt_catalog_adapters(self) -> None:
        """At start: register the catalog's adapters of the models served here that the config did
        not list (loaded at runtime before this worker started), so a worker that joins or restarts
        serves every adapter its peers serve."""
        catalog = self.worker.catalog
        if catalog is None:
            return
        backoff = 0.1
        while True:
            try:
                entries = await catalog.registry.list(Bucket.ADAPTERS)
                break
            except (TidalError, OSError):
                await asyncio.sleep(backoff)
                backoff = min(2.0, backoff * 2)
        for entry in entries:
            record = entry.record
            if not isinstance(record, AdapterRecord):
                continue
            serving = [i for i in self.worker.instances.values() if i.model == record.base]
            if not serving or all(record.name in i.adapters for i in serving):
                continue
            reply = await self._load(LoadAdapter(idempotency_key=f"adopt-{record.name}"[:128], adapter=record.name,
                                                 base=record.base, path=record.path))
            if isinstance(reply, CtlRefused):
                log.warning("catalog adapter not registered here", adapter=record.name, code=reply.code,
                            error=reply.message)

    # --- evict ------------------------------------------------------------------------------------
    async def _evict(self, msg: EvictAdapter) -> CtlReply:
        name = msg.adapter
        instances = [inst for inst in self.worker.instances.values() if name in inst.adapters]
        if name in self.loading or name in self.offloading:
            return self._refused(msg, "busy", f"adapter {name!r} is being loaded or offloaded here; retry later")
        if not instances:
            if name in self.evicting:
                return self._done(msg, f"adapter {name!r} is already being evicted")
            return self._refused(msg, "not_found", f"adapter {name!r} is not registered on {self.worker.worker_id}")
        for inst in instances:  # from now on every assignment naming it is refused
            inst.adapters = inst.adapters - {name}
        self.evicting.add(name)
        running = self._users(name)
        if running:
            self._spawn(self._remove_after_drain(name, instances))
            detail = f"adapter {name!r} takes no new requests; removed once its {len(running)} running ones finish"
        else:
            try:
                await self._remove(name, instances)
            finally:
                self.evicting.discard(name)
            detail = f"adapter {name!r} removed"
        await self._changed(instances)
        log.info("LoRA adapter evicted", adapter=name, running=len(running),
                 instances=[i.instance_id for i in instances])
        return self._done(msg, detail)

    async def _remove_after_drain(self, name: str, instances: list[ModelInstance]) -> None:
        try:
            while self._users(name):
                await asyncio.sleep(DRAIN_POLL_S)
            await self._remove(name, instances)
            log.info("LoRA adapter removed after its requests finished", adapter=name)
        except Exception:
            log.exception("LoRA adapter not removed", adapter=name)
        finally:
            self.evicting.discard(name)

    @staticmethod
    async def _remove(name: str, instances: list[ModelInstance]) -> None:
        for inst in instances:
            await inst.run_on_engine(lambda engine: engine.remove_lora(name))

    # --- offload (the device copy only) -----------------------------------------------------------
    async def _offload(self, msg: OffloadAdapter) -> CtlReply:
        name, worker = msg.adapter, self.worker
        instances = [inst for inst in worker.instances.values() if name in inst.adapters]
        if not instances:
            return self._refused(msg, "not_found", f"adapter {name!r} is not registered on {worker.worker_id}")
        if name in self.loading or name in self.evicting or name in self.offloading:
            return self._refused(msg, "busy", f"adapter {name!r} is being loaded, evicted or offloaded here; "
                                              "retry later")
        running = self._users(name)
        if running:  # a cold adapter only: its requests would load it again at once
            return self._refused(msg, "busy", f"{len(running)} requests admitted on {worker.worker_id} use adapter "
                                              f"{name!r} (e.g. {running[0]}); offload it once they have finished")
        self.offloading.add(name)
        freed: dict[str, int] = {}
        try:
            for inst in instances:
                try:
                    got = await inst.run_on_engine(lambda _engine, i=inst: _offload_on_engine(i, name))
                    freed[inst.instance_id] = got if isinstance(got, int) else 0
                except AdapterInUse as exc:
                    return self._refused(msg, "busy", f"{exc}; retry once it is cold")
                except AdapterPinnedError as exc:
                    return self._refused(msg, "invalid", f"{exc} (it was loaded with pinned=true)")
                except KeyError:  # unregistered on the engine meanwhile
                    return self._refused(msg, "not_found", f"adapter {name!r} is not registered on "
                                                           f"{inst.instance_id}")
        finally:
            self.offloading.discard(name)
            if freed:
                await worker.publish_stats()  # the planner sees the freed bytes and the residency now
        total = sum(freed.values())
        log.info("LoRA adapter offloaded from the device", adapter=name, freed_bytes=total, instances=freed)
        if total == 0:
            return self._done(msg, f"adapter {name!r}: not resident on the device of {worker.worker_id}; "
                                   "still registered")
        return self._done(msg, f"adapter {name!r}: {total} device bytes freed "
                               f"({', '.join(f'{i} {b} B' for i, b in freed.items())}); still registered, "
                               "reloaded on its next use")

    # --- shared -----------------------------------------------------------------------------------
    def _users(self, name: str) -> list[str]:
        """Requests admitted here (running or queued for the engine) that name `name`."""
        return [rid for rid, entry in self.worker.active.items() if entry.assignment.adapter == name]

    async def _changed(self, instances: list[ModelInstance]) -> None:
        """Tell the dispatchers now (stats) and the catalog (instance records) what the instances serve."""
        worker = self.worker
        await worker.publish_stats()
        if worker.catalog is None:
            return
        for inst in instances:
            adapters = sorted(inst.adapters)

            def change(current: InstanceRecord | None, adapters: list[str] = adapters) -> InstanceRecord | None:
                if current is None or current.adapters == adapters:
                    return None  # not registered yet (it will be, with them) or already so
                return msgspec.structs.replace(current, adapters=adapters)

            try:
                await asyncio.wait_for(worker.catalog.registry.modify(Bucket.INSTANCES, inst.instance_id, change),
                                       REGISTRY_TIMEOUT_S)
            except (asyncio.TimeoutError, TidalError, OSError) as exc:
                log.warning("instance record not updated", instance=inst.instance_id, error=repr(exc))

    def _done(self, msg: AdapterCommand, detail: str) -> CtlDone:
        return CtlDone(idempotency_key=msg.idempotency_key, command=type(msg).__name__,
                       worker_id=self.worker.worker_id, detail=detail[:MAX_DETAIL])

    def _refused(self, msg: AdapterCommand, code: CtlRefusedCode, message: str) -> CtlRefused:
        return CtlRefused(idempotency_key=msg.idempotency_key, command=type(msg).__name__,
                          worker_id=self.worker.worker_id, code=code, message=message[:MAX_DETAIL])


__all__ = ["AdapterCommand", "AdapterControl"]
