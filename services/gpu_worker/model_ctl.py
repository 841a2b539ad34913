"""Instances that come and go: the worker's `LoadModel`, `EvictModel` and `Prewarm` (WarmServe).

* `LoadModel(model, instance_id)`: start an instance of any catalog model (the config's `models`
  are only the initial placement). Its weights come from what is warm here (services/gpu_worker/
  prewarm.py: used as they are, no copy, no checkpoint read for them), the rest from the
  checkpoint. When the first layers are warm but not all, the instance registers and serves at
  once while the other layers load on a thread of their own (engine/preloaded.py `LayerLoader`):
  loading overlaps the first prefills. Then the instance is registered (stats at once, the
  catalog's ModelRecord and InstanceRecord) and takes traffic. Answered when it serves.
* `EvictModel(model | instance_id, drain)`: the instance stops admitting at once (stats at once:
  dispatchers route elsewhere, queue, or ask the planner). `drain=true` (default): its running
  requests finish, then it stops; `drain=false` with requests running is refused `busy` — move
  them first (`MigrateOut`) — so an evict never cuts a stream. Its weights stay in the pool as
  kind `prewarm` through the worker's `grace_period`, then are freed; a LoadModel meanwhile starts
  on them. The reply does not wait for the drain. With no instance, the model's warm bytes are freed.
* `Prewarm(model, layers)`: read a model's first layers (`layers.start` = 0) into the pool as kind
  `prewarm`, taking free KV blocks if need be, never live KV; nothing serves them until a LoadModel.
  `[policies] prewarm = false`: refused `unsupported`, and an evicted instance's weights are freed
  at once (no grace period).

Refusals (`CtlRefused`, a log line and `tidal_worker_model_commands_total{outcome}`): `not_found`
(not in the catalog; nothing to evict), `insufficient_memory` (the model cannot fit the pool: the
message names the bytes), `busy` (draining, another command on the model, an evict of running
requests without drain), `invalid` (layers that are not a model's first ones), `unsupported`
(loading from a peer, a partial LoadModel), `conflict` (an idempotency key reused). Idempotent per
key: a retry gets the first outcome with `replayed=True`. One command per model at a time.
"""
from __future__ import annotations

import asyncio
import time
from collections.abc import Coroutine
from typing import TYPE_CHECKING, Any, Protocol

from prometheus_client import Counter

from services.gpu_worker.ctl_idempotency import IdempotentCommands
from services.gpu_worker.engine.loader import CHECKPOINT_OPENS
from services.gpu_worker.engine.memory_pool import MemoryPool
from services.gpu_worker.engine.model_config import CheckpointError, load_model_config
from services.gpu_worker.engine.preloaded import PreloadedWeights, model_weight_bytes
from services.gpu_worker.instance import ModelInstance
from services.gpu_worker.instance_snapshot import InstanceSnapshot
from services.gpu_worker.loading import LoadError, load_instance
from services.gpu_worker.prewarm import PREWARM_TENANT, PrewarmStore, ServingGate
from shared.bus import Delivery
from shared.config import ClusterConfig, WorkerSpec
from shared.events.ctl import CtlDone, CtlRefused, CtlRefusedCode, CtlReply, EvictModel, LoadModel, Prewarm
from shared.logging import get_logger
from shared.metrics import REGISTRY

if TYPE_CHECKING:
    from services.gpu_worker.admission import Active
    from services.gpu_worker.adapter_ctl import AdapterControl
    from shared.bus import Bus
    from shared.events import PoolBreakdown

log = get_logger("tidal.gpu_worker.models")

ModelCommand = LoadModel | EvictModel | Prewarm
COMMANDS = Counter("tidal_worker_model_commands_total", "LoadModel / EvictModel / Prewarm by outcome (done or the "
                   "refusal code)", ["command", "outcome"], registry=REGISTRY)
CHECKPOINT_READS = Counter("tidal_worker_checkpoint_opens_total", "safetensors files opened to start or prewarm "
                           "a model (0 for a start on warm weights)", registry=REGISTRY)
DRAIN_POLL_S = 0.05
PREWARM_YIELD_MAX_S = 10.0  # a prewarm read waits for the worker's requests this long at most (ctl_timeout: 30 s)
MAX_DETAIL = 1000


class ModelHost(Protocol):
    """What model commands need of the worker (GpuWorker is one): its instances come and go through it."""

    worker_id: str
    instances: "dict[str, ModelInstance]"
    active: "dict[str, Active]"
    draining: bool
    adapter_ctl: "AdapterControl"

    @property
    def bus(self) -> "Bus": ...

    async def add_instance(self, inst: ModelInstance) -> None: ...

    def remove_instance(self, inst: ModelInstance) -> None: ...

    def catalog_state(self, inst: ModelInstance, state: str) -> None: ...

    def pool_breakdown(self) -> "PoolBreakdown": ...

    async def publish_stats(self) -> None: ...


class ModelControl:
    def __init__(self, worker: ModelHost, cfg: ClusterConfig, spec: WorkerSpec, pool: MemoryPool, threads: int) -> None:
        self.worker, self.cfg, self.spec, self.pool, self.threads = worker, cfg, spec, pool, threads
        self.prewarm_enabled = cfg.policies.prewarm
        self.grace_s = float(spec.grace_period) if self.prewarm_enabled else 0.0
        self.store = PrewarmStore(pool)
        self.busy: set[str] = set()  # models with a command under way
        self._tasks: set[asyncio.Task[None]] = set()
        self.commands: IdempotentCommands[ModelCommand] = IdempotentCommands(
            run=self._run, refused=self._refused, spawn=self._spawn, failed_message="model command failed")

    # --- the handler (GpuWorker.on_ctl) ------------------------------------------------------------
    async def handle(self, msg: ModelCommand, ctx: Delivery) -> CtlReply | None:
        return self.commands.handle(msg, ctx, self.worker.bus)  # answered from its own task

    def _spawn(self, work: Coroutine[Any, Any, None]) -> None:
        task = asyncio.ensure_future(work)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _run(self, msg: ModelCommand) -> CtlReply:
        name = type(msg).__name__
        try:
            if isinstance(msg, LoadModel):
                reply = await self._load(msg)
            elif isinstance(msg, EvictModel):
                reply = await self._evict(msg)
            else:
                reply = await self._prewarm(msg)
        except Exception:
            log.exception("model command failed", command=name, model=msg.model)
            COMMANDS.labels(name, "error").inc()
            raise
        COMMANDS.labels(name, "done" if isinstance(reply, CtlDone) else reply.code).inc()
        if isinstance(reply, CtlRefused):
            log.warning("model command refused", command=name, model=msg.model, code=reply.code, error=reply.message)
        return reply

    def _check(self, msg: ModelCommand) -> CtlRefused | None:
        """Refusals every command shares: an unknown model, draining, another command on the model."""
        if msg.model not in {m.name for m in self.cfg.models}:
            known = ", ".join(sorted(m.name for m in self.cfg.models))
            return self._refused(msg, "not_found", f"model {msg.model!r} is not in the catalog (it has: {known})")
        if self.worker.draining:
            return self._refused(msg, "busy", f"worker {self.worker.worker_id} is draining")
        if msg.model in self.busy:
            return self._refused(msg, "busy", f"another command on {msg.model!r} is under way here; retry later")
        return None

    def _fits(self, msg: ModelCommand, nbytes: int, what: str) -> CtlRefused | None:
        if nbytes > self.pool.capacity_bytes:
            return self._refused(msg, "insufficient_memory", f"{what} of {msg.model!r} need {nbytes} B; the pool of "
                                                             f"{self.worker.worker_id} holds {self.pool.capacity_bytes} B")
        return None

    # --- LoadModel --------------------------------------------------------------------------------
    async def _load(self, msg: LoadModel) -> CtlReply:
        refusal = self._check(msg)
        if refusal is not None:
            return refusal
        if msg.peer is not None:
            return self._refused(msg, "unsupported", "loading weights from a peer is not implemented; omit `peer`")
        current = self._instance_of(msg.model)
        if current is not None:
            if current.instance_id == msg.instance_id and current.accepting:
                return self._done(msg, f"{msg.instance_id} already serves {msg.model!r}")
            return self._refused(msg, "busy", f"{current.instance_id} of {msg.model!r} is here "
                                              f"({'serving' if current.accepting else 'being evicted'}); retry later")
        spec = self.cfg.model(msg.model)
        mcfg = load_model_config(str(spec.path), spec.dtype)
        if msg.layers is not None and (msg.layers.start, msg.layers.end) != (0, mcfg.num_layers):
            return self._refused(msg, "unsupported", f"an instance holds all {mcfg.num_layers} layers of "
                                                     f"{msg.model!r}; prewarm first layers with Prewarm")
        weights, _layer = model_weight_bytes(mcfg)
        refusal = self._fits(msg, weights, "the weights")
        if refusal is not None:
            return refusal
        self.busy.add(msg.model)
        try:
            warm = self.store.take(msg.model)
            warm_layers = len(warm.layers) if warm is not None else 0
            background = (self.prewarm_enabled and warm is not None and warm.first_layers > 0
                          and not warm.covers(mcfg.num_layers))
            opens = CHECKPOINT_OPENS[0]
            try:
                inst = await asyncio.to_thread(load_instance, self.cfg, self.spec, msg.model, self.pool, self.threads,
                                               instance=msg.instance_id, preloaded=warm, background_load=background)
            except LoadError as exc:
                self._rewarm(msg.model, warm)
                code: CtlRefusedCode = "insufficient_memory" if isinstance(exc.__cause__, MemoryError) else "invalid"
                return self._refused(msg, code, str(exc))
            opened = CHECKPOINT_OPENS[0] - opens
            CHECKPOINT_READS.inc(opened)
            await self.worker.add_instance(inst)
        finally:
            self.busy.discard(msg.model)
        self._spawn(self.worker.adapter_ctl.adopt_catalog_adapters())  # adapters loaded at runtime elsewhere
        source = ("warm weights" if warm is not None and warm.covers(mcfg.num_layers)
                  else f"{warm_layers} warm layers + the checkpoint" + (" (loading while serving)" if background else "")
                  if warm is not None else "the checkpoint")
        log.info("model instance started", instance=inst.instance_id, model=msg.model, source=source,
                 warm_layers=warm_layers, checkpoint_opens=opened, plan_id=msg.plan_id)
        return self._done(msg, f"{inst.instance_id} serves {msg.model!r} from {source}; warm_layers={warm_layers} "
                               f"checkpoint_opens={opened}")

    def _rewarm(self, model: str, warm: PreloadedWeights | None) -> None:
        """A start that failed gives the warm weights it took back (if they still fit)."""
        if warm is None:
            return
        try:
            self.store.put(model, warm, source="prewarm", expires_at=time.monotonic() + self.grace_s)
        except MemoryError:
            log.info("warm weights of a failed start dropped", model=model)

    # --- EvictModel -------------------------------------------------------------------------------
    async def _evict(self, msg: EvictModel) -> CtlReply:
        inst = (self.worker.instances.get(msg.instance_id) if msg.instance_id is not None
                else self._instance_of(msg.model))
        if inst is None or inst.model != msg.model:
            if msg.instance_id is None and msg.model not in self.busy:
                freed = self.store.release(msg.model)
                if freed:
                    await self.worker.publish_stats()
                    return self._done(msg, f"freed {freed} B of warm weights of {msg.model!r}")
            what = msg.instance_id or f"an instance of {msg.model!r}"
            return self._refused(msg, "not_found", f"{what} is not on {self.worker.worker_id}, nor are warm weights")
        if msg.model in self.busy:
            return self._refused(msg, "busy", f"another command on {msg.model!r} is under way here; retry later")
        running = self._users(inst)
        if running and not msg.drain:
            return self._refused(msg, "busy", f"{len(running)} requests run on {inst.instance_id}: evict with "
                                              "drain=true (they finish first) or migrate them first")
        self.busy.add(msg.model)
        inst.accepting = False  # from now on its assignments are refused
        await self.worker.publish_stats()
        self.worker.catalog_state(inst, "draining")
        if running:
            self._spawn(self._retire_after_drain(inst))
            return self._done(msg, f"{inst.instance_id} takes no new requests; stops once its {len(running)} "
                                   "running ones finish")
        await self._retire(inst)
        return self._done(msg, f"{inst.instance_id} stopped; {self._kept(msg.model)}")

    async def _retire_after_drain(self, inst: ModelInstance) -> None:
        try:
            while self._users(inst):
                await asyncio.sleep(DRAIN_POLL_S)
            await self._retire(inst)
        except Exception:
            log.exception("instance not retired", instance=inst.instance_id)
            self.busy.discard(inst.model)

    async def _retire(self, inst: ModelInstance) -> None:
        """Stop the engine thread, keep the weights warm through the grace period (or free them)."""
        try:
            runner = inst.engine.runner
            if runner.loading is not None:
                await asyncio.to_thread(runner.loading.join)
            await asyncio.to_thread(inst.stop)
            self.worker.remove_instance(inst)
            if self.grace_s > 0:
                kept = self.store.put(inst.model, PreloadedWeights.from_runner(runner), source="evicted",
                                      expires_at=time.monotonic() + self.grace_s, from_tenant=inst.instance_id)
            else:
                self.pool.release_tenant(inst.instance_id)
                kept = 0
            log.info("model instance stopped", instance=inst.instance_id, model=inst.model, warm_bytes=kept,
                     grace_s=self.grace_s)
            self.worker.catalog_state(inst, "stopped")
            await self.worker.publish_stats()
        finally:
            self.busy.discard(inst.model)

    def _kept(self, model: str) -> str:
        nbytes = self.store.bytes_of(model)
        return f"{nbytes} B kept warm for {self.grace_s:g}s" if nbytes else "its weights freed"

    # --- Prewarm ----------------------------------------------------------------------------------
    async def _prewarm(self, msg: Prewarm) -> CtlReply:
        refusal = self._check(msg)
        if refusal is not None:
            return refusal
        if not self.prewarm_enabled:
            return self._refused(msg, "unsupported", "prewarming is off on this cluster ([policies] prewarm = false)")
        if msg.peer is not None:
            return self._refused(msg, "unsupported", "prewarming from a peer is not implemented; omit `peer`")
        if self._instance_of(msg.model) is not None:
            return self._refused(msg, "invalid", f"{msg.model!r} is served here already")
        spec = self.cfg.model(msg.model)
        mcfg = load_model_config(str(spec.path), spec.dtype)
        layers = range(msg.layers.start, msg.layers.end)
        if layers.start != 0 or not 0 < layers.stop <= mcfg.num_layers:
            return self._refused(msg, "invalid", f"prewarm holds a model's first layers: [0, k) with 0 < k <= "
                                                 f"{mcfg.num_layers}, got [{layers.start}, {layers.stop})")
        capped = self._cap_kv(msg)
        if isinstance(capped, CtlRefused):
            return capped
        if self.store.layers_of(msg.model) >= layers.stop:
            return self._done(msg, f"{msg.model!r} layers [0, {layers.stop}) are warm already")
        total, per_layer = model_weight_bytes(mcfg)
        embed = mcfg.vocab_size * mcfg.hidden_size * mcfg.dtype.itemsize
        need = per_layer * layers.stop + embed + ((total - per_layer * mcfg.num_layers - embed)
                                                  if layers.stop == mcfg.num_layers else 0)
        refusal = self._fits(msg, need, f"layers [0, {layers.stop})")
        if refusal is not None:
            return refusal
        if msg.max_bytes is not None and need > msg.max_bytes:
            return self._refused(msg, "insufficient_memory", f"layers [0, {layers.stop}) of {msg.model!r} need "
                                                             f"{need} B, more than max_bytes {msg.max_bytes} B")
        self.busy.add(msg.model)
        try:
            opens = CHECKPOINT_OPENS[0]
            gate = ServingGate(lambda: bool(self.worker.active),
                               min(PREWARM_YIELD_MAX_S, float(self.cfg.planner.ctl_timeout) / 3))
            try:
                weights = await asyncio.to_thread(PreloadedWeights.read, str(spec.path), mcfg, layers, self.spec.device,
                                                  gate)
            except (CheckpointError, OSError) as exc:
                return self._refused(msg, "invalid", f"{msg.model!r} from {spec.path}: {exc}")
            CHECKPOINT_READS.inc(CHECKPOINT_OPENS[0] - opens)
            try:
                nbytes = self.store.put(msg.model, weights, source="prewarm")
            except MemoryError as exc:
                return self._refused(msg, "insufficient_memory", str(exc))
        finally:
            self.busy.discard(msg.model)
        await self.worker.publish_stats()
        log.info("model prewarmed", model=msg.model, layers=layers.stop, bytes=nbytes, plan_id=msg.plan_id,
                 yielded_s=round(gate.waited_s, 3), paused_layers=gate.pauses)
        return self._done(msg, f"{msg.model!r} layers [0, {layers.stop}) warm: {nbytes} B")

    def _cap_kv(self, msg: Prewarm) -> CtlRefused | int:
        """Proactive prewarming (WarmServe §4.1): cap a grace-period instance's KV at Eq. 1's target
        first, so its free blocks above it become room for the prewarm; returns the bytes given back."""
        if msg.cap_instance_id is None:
            return 0
        inst = self.worker.instances.get(msg.cap_instance_id)
        if inst is None:
            return self._refused(msg, "not_found", f"instance {msg.cap_instance_id} is not on {self.worker.worker_id}")
        if inst.accepting or msg.kv_cap_bytes is None:
            return self._refused(msg, "invalid", f"only a grace-period (evicted, draining) instance's KV is capped, "
                                                 f"with kv_cap_bytes: {msg.cap_instance_id} is "
                                                 f"{'accepting' if inst.accepting else 'draining'}")
        given = inst.engine.blocks.set_cap(msg.kv_cap_bytes)
        log.info("grace-period KV capped", instance=inst.instance_id, cap_bytes=msg.kv_cap_bytes, freed_bytes=given)
        return given

    # --- time and helpers -------------------------------------------------------------------------
    def warm_snapshot(self) -> list[tuple[str, InstanceSnapshot]]:
        """The pool's warm weights as a snapshot for the stats (it also carries the pool's capacity,
        so a worker with no instance reports its pool)."""
        pool = self.pool
        return [(PREWARM_TENANT, InstanceSnapshot(pool_id=id(pool), pool_capacity=pool.capacity_bytes,
                                                  pool_by_owner=pool.by_owner(tenant=PREWARM_TENANT)))]

    def tick(self, now_monotonic: float) -> None:
        """Free warm weights whose grace period is over (the stats loop calls this)."""
        for model, nbytes in self.store.expire(now_monotonic):
            log.info("grace period over: warm weights freed", model=model, bytes=nbytes)

    def _instance_of(self, model: str) -> ModelInstance | None:
        return next((i for i in self.worker.instances.values() if i.model == model), None)

    def _users(self, inst: ModelInstance) -> list[str]:
        return [rid for rid, entry in self.worker.active.items() if entry.instance is inst]

    def _done(self, msg: ModelCommand, detail: str) -> CtlDone:
        return CtlDone(idempotency_key=msg.idempotency_key, command=type(msg).__name__,
                       worker_id=self.worker.worker_id, detail=detail[:MAX_DETAIL],
                       pool=self.worker.pool_breakdown())

    def _refused(self, msg: ModelCommand, code: CtlRefusedCode, message: str) -> CtlRefused:
        return CtlRefused(idempotency_key=msg.idempotency_key, command=type(msg).__name__,
                          worker_id=self.worker.worker_id, code=code, message=message[:MAX_DETAIL])


__all__ = ["ModelControl"]
