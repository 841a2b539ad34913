"""The gpu_worker actor: assignments in, token chunks and stats out.

* `tidal.v1.worker.<id>.assign` — validate (`admission.py`), then hand the request to its instance's engine
  thread. Idempotent per key: a re-delivered assignment is answered `replayed=True` and
  nothing is done twice. Refusals are typed (`AssignRejected.reason`); a malformed
  assignment (token ids outside the vocabulary, nothing left to generate) is a `bad_request`.
* `tidal.v1.req.*.abort` — every worker hears every abort and keeps its own: the engine
  thread applies it before its next step, so the KV blocks are free within one step.
* chunks — each engine step's encoded chunks arrive from the engine thread in one call;
  one publisher task sends them in order (`chunk_publisher.py`: no per-token work on the event loop).
* stats — `WorkerStats` every `stats_interval` (250 ms) and after a change (`stats_reporter.py`);
  heartbeats are the announcer's.
* prefixes — each instance's cached prefixes (`PrefixSummary`, prefix_publisher.py) on change.
* drain (SIGTERM) — assignments are refused with `draining`; admitted requests run to
  the end or to the drain deadline; what is left then is re-dispatched by the dispatcher
  once this worker is marked dead (its chunks so far are not repeated: resume).
* data plane — started with the worker (`dataplane.WorkerDataPlane`; without ucxx, KV
  migration is refused as `unsupported`), its address published in the WorkerRecord,
  closed at stop. Migrations: `migration.py` (MigrateOut runs as a task of its own and
  answers when done), `migration_kv.py` (source), `migration_dest.py` (destination, on
  `tidal.v1.worker.<id>.migrate`: a KV migration's source talking to this worker).
* instances that come and go — `LoadModel` / `EvictModel` / `Prewarm` (`model_ctl.py`, WarmServe):
  `add_instance` / `remove_instance` change the served set at run time; warm weights sit in the
  pool as kind `prewarm` (`prewarm.py`) and show in the stats as holdings of `prewarm/<model>:...`.

The active-request table is touched only on the event loop, never across an await.
"""
from __future__ import annotations

import asyncio
import collections
import contextvars
import time
from collections.abc import Coroutine
from typing import Any

from prometheus_client import Counter

from services.gpu_worker import metrics as worker_metrics
from services.gpu_worker import migration
from services.gpu_worker.adapter_ctl import AdapterControl
from services.gpu_worker.prefix_ctl import PrefixControl
from services.gpu_worker.admission import Active, adapter_users, refusal
from services.gpu_worker.bus_watch import BusWatch, fence_after
from services.gpu_worker.chunk_publisher import ChunkPublisher
from services.gpu_worker.group_ctl import GROUP_COMMANDS, GroupControl
from services.gpu_worker.catalog import CatalogWriter
from services.gpu_worker.dataplane import WorkerDataPlane
from services.gpu_worker.migration_dest import KvInbound
from services.gpu_worker.worker_context import WorkerContext
from services.gpu_worker.instance import ModelInstance
from services.gpu_worker.instance_snapshot import InstanceSnapshot
from services.gpu_worker.prefix_publisher import PrefixPublisher
from services.gpu_worker.stats_reporter import StatsReporter
from shared.actors import Actor
from shared.bus import Delivery
from shared.events import AbortRequest, AssignAccepted, AssignRejected, Assignment, CtlRefused, WorkerState
from shared.announce import Announcer, incarnation
from shared.events.ctl import (
    CtlReply, CtlRequest, EvictAdapter, EvictModel, LoadAdapter, LoadModel, MigrateIn, MigrateKvCancel, MigrateKvStage,
    EvictPrefixBlocks, MigrateOut, MigrateRequest, OffloadAdapter, Prewarm, RestoreLayers,
)
from shared.events.worker import PoolBreakdown
from shared.logging import get_logger
from shared.metrics import REGISTRY
from shared.registry_client import RegistryClient
from shared.service import Service
from shared.subjects import CATALOG, worker_adapters, worker_assign, worker_ctl, worker_migrate, worker_prefixes
from shared.wire import TidalError

log = get_logger("tidal.gpu_worker")

ASSIGNMENTS = Counter("tidal_worker_assignments_total", "Assignments by outcome", ["outcome"], registry=REGISTRY)

IDEMPOTENCY_MEMORY = 100_000  # accepted keys remembered for replay
ABORT_MEMORY = 10_000  # aborts of requests not (yet) here, remembered in case the assignment is late


class GpuWorker(Actor):
    def __init__(self, service: Service, worker_id: str, device: str, *, stats_interval: float = 0.25,
                 max_waiting: int = 256) -> None:
        super().__init__(f"gpu_worker-{worker_id}")
        self.service = service
        self.worker_id = worker_id
        self.device = device
        self.stats_interval = stats_interval
        self.max_waiting = max_waiting  # per instance: admitted but not yet running
        self.instances: dict[str, ModelInstance] = {}
        self.active: dict[str, Active] = {}
        self.accepted: collections.OrderedDict[str, AssignAccepted] = collections.OrderedDict()
        self.early_aborts: collections.OrderedDict[str, None] = collections.OrderedDict()
        self.draining = False
        self.catalog: CatalogWriter | None = None
        self.stats = StatsReporter(worker_id, device, interval=stats_interval, state=lambda: self.state,
                                   publish=lambda subject, msg: self.bus.publish(subject, msg),
                                   warm=self._warm_snapshot, tick=self._tick)
        self.chunks = ChunkPublisher(finished=lambda request_id: self.active.pop(request_id, None))
        self._loop: asyncio.AbstractEventLoop | None = None
        self.announcer: Announcer | None = None  # publishes the data-plane address (set by __main__)
        self.dataplane = WorkerDataPlane(worker_id)
        self.migrating: set[str] = set()  # requests a MigrateOut is moving away from here
        # what the control modules need of the worker: none of them imports this module
        self.ctx = WorkerContext(
            worker_id, self.instances, self.active, self.migrating, self.dataplane, bus=lambda: self.bus,
            draining=lambda: self.draining, catalog=lambda: self.catalog, kv_inbound=lambda: self.kv_inbound,
            spawn_task=self.spawn_task, publish_stats=self.publish_stats, resume_here=self.resume_here,
            crashed=self._crashed)
        self.adapter_ctl = AdapterControl(self.ctx)  # Load/Evict/OffloadAdapter (services/gpu_worker/adapter_ctl.py)
        self.prefix_ctl = PrefixControl(self.ctx)  # EvictPrefixBlocks: the economy's `prefix` source (prefix_ctl.py)
        # JoinGroup / DropLayers / LeaveGroup (services/gpu_worker/group_ctl.py)
        self.group_ctl = GroupControl(worker_id, self.instances, self.dataplane, bus=lambda: self.bus,
                                      spawn_task=self.spawn_task, crashed=self._crashed,
                                      publish_stats=self.publish_stats)
        self.kv_inbound = KvInbound(  # KV migrations into this worker
            worker_id, self.instances, self.active, self.dataplane, draining=lambda: self.draining,
            heard=self.group_ctl.watch.heard, dead_after=lambda: self.group_ctl.watch.dead_after)
        self._tasks: set[asyncio.Task[Any]] = set()  # migrations under way (answered when done)
        self.model_ctl: Any = None  # LoadModel / EvictModel / Prewarm (model_ctl.ModelControl; set by __main__)
        self.activated = False  # the configured instances (maybe none) are loaded

    # --- lifecycle ----------------------------------------------------------------------------
    async def on_start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self.chunks.bind(self._loop)
        await self.bind(worker_assign(self.worker_id), Assignment, self.on_assign)
        await self.bind(CATALOG["request.abort"].wildcard, AbortRequest, self.on_abort, label="tidal.v1.req.*.abort")
        await self.bind(worker_ctl(self.worker_id), CtlRequest, self.on_ctl)
        # adapter commands only (what the gateway may send; NATS keeps it off `worker.ctl`)
        await self.bind(worker_adapters(self.worker_id), CATALOG["worker.adapters"].payload_type, self.on_ctl)
        await self.bind(worker_migrate(self.worker_id), MigrateRequest, self.on_migrate)
        self.spawn("publisher", lambda: self.chunks.run(self.bus.nc))
        self.spawn("stats", self.stats.run)
        prefixes = PrefixPublisher(self.worker_id, self.instances, lambda m: self.bus.publish(worker_prefixes(), m))
        self.spawn("prefixes", prefixes.run)  # each instance's cached prefixes, for prefix-aware routing
        self.bus_watch = BusWatch(lambda timeout: self.bus.nc.flush(timeout=timeout), self._fence_self,
                                  fence_after_s=lambda: fence_after(self.group_ctl.watch.dead_after))
        self.spawn("bus_watch", self.bus_watch.run)
        await self.dataplane.start(RegistryClient(self.bus, timeout=2.0))
        await self.group_ctl.start()  # buddy-group frames may come before this worker's JoinGroup
        if self.announcer is not None:
            self.announcer.set_ucx_address(self.dataplane.address)

    async def activate(self, instances: list[ModelInstance], *, catalog: CatalogWriter | None = None) -> None:
        """Serve these (loaded) instances: start their engine threads and register them."""
        self.catalog = catalog
        for inst in instances:
            self.instances[inst.instance_id] = inst
            inst.start(self.chunks.emitted, self._crashed)
        self.stats.serve(list(self.instances.values()), adapter_users=lambda: adapter_users(self.active))
        self.activated = True
        if self.catalog is not None:
            self.spawn("catalog", self.catalog.register_until_done)
            self.spawn("adapters", self.adapter_ctl.adopt_catalog_adapters)  # ones loaded at runtime before we came

    async def drain(self, service: Service) -> None:
        """on_drain hook: refuse new work; let admitted requests finish up to the drain deadline."""
        self.draining = True
        deadline = time.monotonic() + max(0.0, service.settings.drain_timeout_s - 1.0)
        if self.catalog is not None:
            await self._catalog_state("draining", timeout=1.0)
        while self.active and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        if self.active:
            log.warning("drain deadline: requests left unfinished (the dispatcher re-dispatches them)",
                        requests=sorted(self.active)[:20], count=len(self.active))
        else:
            log.info("drained: every admitted request finished")
        await asyncio.sleep(2 * self.stats_interval)  # let the last chunks and stats go out

    async def on_stop(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await self.kv_inbound.close()
        self.group_ctl.close()
        await asyncio.gather(*(asyncio.to_thread(inst.stop) for inst in self.instances.values()))
        await self.dataplane.close()
        if self.catalog is not None:
            await self._catalog_state("stopped", timeout=1.0)

    async def _catalog_state(self, state: str, *, timeout: float) -> None:
        assert self.catalog is not None
        try:
            await asyncio.wait_for(self.catalog.set_state(state), timeout)
        except (asyncio.TimeoutError, TidalError, OSError) as exc:
            log.warning("instance state not written to the registry", state=state, error=repr(exc))

    @property
    def state(self) -> WorkerState:
        if self.draining or self.service.state == "draining":
            return WorkerState.DRAINING
        return WorkerState.READY if self.service.state == "ready" and self.activated else WorkerState.STARTING

    # --- instances that come and go (model_ctl.py) ---------------------------------------------
    async def add_instance(self, inst: ModelInstance) -> None:
        """Serve a loaded instance from now on: its engine thread, stats at once, the catalog."""
        inst.start(self.chunks.emitted, self._crashed)
        self.instances[inst.instance_id] = inst
        self.stats.set_instances(list(self.instances.values()))
        await self.publish_stats()
        if self.catalog is not None:
            self.spawn_task(self.catalog.add(inst))

    def remove_instance(self, inst: ModelInstance) -> None:
        """Stop routing to and reporting an instance whose engine thread has stopped."""
        self.instances.pop(inst.instance_id, None)
        self.stats.set_instances(list(self.instances.values()))

    def catalog_state(self, inst: ModelInstance, state: str) -> None:
        if self.catalog is not None:
            self.spawn_task(self.catalog.set_instance_state(inst, state))

    def _warm_snapshot(self) -> list[tuple[str, InstanceSnapshot]]:
        """The pool's warm weights and capacity for the stats (no instance owns them)."""
        return self.model_ctl.warm_snapshot() if self.model_ctl is not None else []

    def pool_breakdown(self) -> PoolBreakdown:
        return self.stats.pool_breakdown(list(self.instances.values()))

    async def publish_stats(self) -> None:
        await self.stats.publish_now()

    # --- assignments ----------------------------------------------------------------------------
    async def on_assign(self, a: Assignment, _ctx: Delivery) -> AssignAccepted | AssignRejected:
        """A request to run here: from the dispatcher, or a migration's hand-over from another worker
        (`kv_computed_tokens`: attach on the moved blocks reserved here)."""
        done = self.accepted.get(a.idempotency_key)
        if done is not None:
            ASSIGNMENTS.labels("replayed").inc()
            return AssignAccepted(request_id=done.request_id, worker_id=done.worker_id, instance_id=done.instance_id,
                                  replayed=True)
        refused = refusal(a, worker_id=self.worker_id, draining=self.draining, instances=self.instances,
                          active=self.active, max_waiting=self.max_waiting)
        if refused is not None:
            reason, message = refused
            ASSIGNMENTS.labels(reason).inc()
            return AssignRejected(request_id=a.request_id, worker_id=self.worker_id, reason=reason, message=message,
                                  retry_after_s=1.0 if reason in ("no_capacity", "draining") else None)
        inst = self.instances[a.instance_id]
        if not a.kv_computed_tokens and a.request_id in self.kv_inbound.reservations:
            # not a migration's commit: its source died (a re-dispatch) or handed it over by tokens
            await self.kv_inbound.drop(a.request_id, f"assigned anew ({a.idempotency_key}) without moved KV")
        if a.kv_computed_tokens:
            rejected = await self.kv_inbound.commit(a)  # the engine holds it when this returns None
            if rejected is not None:
                ASSIGNMENTS.labels(rejected.reason).inc()
                return rejected
            self.active[a.request_id] = Active(inst, a.idempotency_key, a.deadline_ts, a)
        else:
            self.active[a.request_id] = Active(inst, a.idempotency_key, a.deadline_ts, a)
            inst.submit(a)
        if a.request_id in self.early_aborts:  # its abort overtook it
            del self.early_aborts[a.request_id]
            self._abort(a.request_id)
        reply = AssignAccepted(request_id=a.request_id, worker_id=self.worker_id, instance_id=a.instance_id)
        self.accepted[a.idempotency_key] = reply
        if len(self.accepted) > IDEMPOTENCY_MEMORY:
            self.accepted.popitem(last=False)
        ASSIGNMENTS.labels("accepted").inc()
        return reply

    # --- aborts ---------------------------------------------------------------------------------
    async def on_abort(self, msg: AbortRequest, _ctx: Delivery) -> None:
        if msg.targeted:  # a superseded copy only (the dispatcher re-dispatched it, or a hand-over failed)
            entry = self.active.get(msg.request_id)
            if entry is not None and msg.stops(self.worker_id, entry.assignment.attempt, entry.assignment.handover):
                log.info("stopping a superseded copy", request_id=msg.request_id, attempt=entry.assignment.attempt,
                         handover=entry.assignment.handover, current=(msg.attempt, msg.handover))
                self._abort(msg.request_id)
            return
        if msg.request_id in self.active:
            self._abort(msg.request_id)
        elif msg.request_id not in self.early_aborts and msg.ts > time.time() - 60:
            self.early_aborts[msg.request_id] = None
            if len(self.early_aborts) > ABORT_MEMORY:
                self.early_aborts.popitem(last=False)

    def _abort(self, request_id: str) -> None:
        entry = self.active.get(request_id)
        if entry is not None and not entry.aborted:
            entry.aborted = True
            entry.instance.abort(request_id)

    def _fence_self(self, silent_s: float) -> None:
        """Cut off from the bus past `dead_after` (services/gpu_worker/bus_watch.py): the cluster has
        re-dispatched what runs here. Drop it all without ending the streams (they go on elsewhere) and
        come back as a new incarnation, so a dispatcher that did not hear of the loss re-dispatches too."""
        dropped = [rid for rid in self.active if rid not in self.migrating]
        if not dropped:  # nothing ran here (e.g. a stall while loading a model): nothing to hand back
            return
        log.warning("fenced: dropping every assignment", requests=len(dropped), silent_s=round(silent_s, 2))
        for rid in dropped:
            self.spawn_task(self._drop(rid))
        if self.announcer is not None:
            self.announcer.incarnation = incarnation(self.announcer.service_id)
            self.spawn_task(self._beat_now())

    async def _drop(self, request_id: str) -> None:
        entry = self.active.pop(request_id, None)
        if entry is not None:
            await entry.instance.detach(request_id)  # out of the engine; no final chunk (its stream is elsewhere)

    async def _beat_now(self) -> None:
        try:
            assert self.announcer is not None
            await self.announcer.beat()
        except Exception as exc:  # still cut off: the next regular heartbeat carries it
            log.info("new incarnation not announced yet", error=repr(exc))

    def resume_here(self, a: Assignment) -> None:
        """Run `a` (resume tokens, next_seq) on this worker again: a migration that failed."""
        inst = self.instances[a.instance_id]
        self.active[a.request_id] = Active(inst, a.idempotency_key, a.deadline_ts, a)
        inst.submit(a)

    # --- control commands (the other mechanisms arrive with later issues) -----------------------
    async def on_ctl(self, msg: object, _ctx: Delivery) -> CtlReply | None:
        deadline = getattr(msg, "deadline_ts", None)
        if deadline is not None and time.time() > deadline:  # held up (a partition): decided on a gone view
            log.warning("stale control command dropped", command=type(msg).__name__,
                        late_s=round(time.time() - deadline, 2))
            return CtlRefused(idempotency_key=msg.idempotency_key, command=type(msg).__name__,  # type: ignore[attr-defined]
                              worker_id=self.worker_id, code="expired",
                              message=f"arrived {time.time() - deadline:.1f}s after its deadline; not executed")
        if isinstance(msg, (LoadAdapter, EvictAdapter, OffloadAdapter)):
            return await self.adapter_ctl.handle(msg, _ctx)  # may answer later, from its own task
        if isinstance(msg, EvictPrefixBlocks):
            return await self.prefix_ctl.handle(msg, _ctx)  # answered from its own task
        if isinstance(msg, (LoadModel, EvictModel, Prewarm)) and self.model_ctl is not None:
            return await self.model_ctl.handle(msg, _ctx)  # answered from its own task
        if isinstance(msg, RestoreLayers):  # answered once the layers are back (as KV frees): its own task
            self.spawn_task(self._restore_layers(msg, _ctx))
            return None
        if isinstance(msg, GROUP_COMMANDS):
            return await self.group_ctl.handle(msg)
        if isinstance(msg, MigrateOut):  # answered when the move is over; the worker serves meanwhile
            self.spawn_task(self._migrate_out(msg, _ctx))
            return None
        if isinstance(msg, MigrateIn):
            return await migration.migrate_in(self.ctx, msg)
        return CtlRefused(idempotency_key=msg.idempotency_key, command=type(msg).__name__,  # type: ignore[attr-defined]
                          worker_id=self.worker_id, code="unsupported",
                          message=f"{type(msg).__name__} is not implemented by this worker yet")

    async def _restore_layers(self, msg: RestoreLayers, ctx: Delivery) -> None:
        reply = await self.group_ctl.handle(msg)
        if ctx.reply:
            await self.bus.respond(ctx, reply)

    async def on_migrate(self, msg: object, _ctx: Delivery) -> CtlReply:
        """A KV migration's source talking to this worker, its destination."""
        if isinstance(msg, MigrateKvStage):
            return await self.kv_inbound.stage(msg)
        if isinstance(msg, MigrateKvCancel):
            return await self.kv_inbound.cancel(msg)
        assert isinstance(msg, MigrateIn)
        return await migration.migrate_in(self.ctx, msg)

    async def _migrate_out(self, msg: MigrateOut, ctx: Delivery) -> None:
        try:
            reply = await migration.migrate_out(self.ctx, msg)
        except Exception as exc:  # a bug: say so rather than leave the caller waiting
            log.exception("migration failed unexpectedly", request_id=msg.request_id)
            reply = migration.refused(self.ctx, msg, "busy", f"internal error migrating {msg.request_id}: {exc!r}")
        worker_metrics.record_migration(self.worker_id, msg, reply)
        if ctx.reply:
            await self.bus.respond(ctx, reply)

    def spawn_task(self, coro: Coroutine[Any, Any, Any]) -> None:
        """Run `coro` beside the mailbox (a fresh context: not bound to the deadline of the message
        that started it); cancelled at stop."""
        task = asyncio.get_running_loop().create_task(coro, context=contextvars.Context())
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    # --- engine threads ---------------------------------------------------------------------------
    def _crashed(self, instance_id: str, exc: BaseException) -> None:
        """An engine thread died: its requests are lost here; exit so the dispatcher re-dispatches them."""
        assert self._loop is not None
        log.critical("engine failed; stopping the worker", instance=instance_id, error=repr(exc))
        try:
            self._loop.call_soon_threadsafe(self.service.request_stop, 1)
        except RuntimeError:  # the loop is closed: the process is exiting anyway
            pass

    # --- each stats round (stats_reporter.py) ---------------------------------------------------
    def _tick(self, now: float) -> None:
        """Before the stats are built: requests past their deadline go, warm weights past their grace period too."""
        for request_id, entry in list(self.active.items()):
            if entry.deadline_ts is not None and now > entry.deadline_ts:
                self._abort(request_id)
        if self.model_ctl is not None:
            self.model_ctl.tick(time.monotonic())
