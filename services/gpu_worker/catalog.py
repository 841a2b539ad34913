"""The worker's entries in the registry catalog: its models, their adapters, its instances.

A `ModelRecord` carries what the gateway needs to accept a request for the model without
loading it: `path` (the Hugging Face directory holding tokenizer.json and the chat template)
and `max_context` (the context the engine serves: the config's `max_context` capped by the
checkpoint's). Models and adapters are shared by every worker serving them: a worker writes
one only when it is absent or differs, with compare-and-set. `InstanceRecord`s are this
worker's own: `ready` once loaded, `draining` on SIGTERM, `stopped` at a clean exit.

Instances come and go at run time (`LoadModel` / `EvictModel`, model_ctl.py): `add` writes a new
one's records, `set_instance_state` marks one draining or stopped. A model of the catalog that no
worker has loaded yet still gets its `ModelRecord` (from its config.json alone, written only when
absent), so the gateway accepts requests for it and the dispatcher queues them until the planner
scales it up.
"""
from __future__ import annotations

import asyncio
from typing import Any

from services.gpu_worker.engine.model_config import CheckpointError, load_model_config
from services.gpu_worker.engine.preloaded import model_weight_bytes
from services.gpu_worker.instance import ModelInstance
from shared.config import ClusterConfig
from shared.events import AdapterRecord, Bucket, InstanceRecord, LayerRange, ModelRecord, Record
from shared.logging import get_logger
from shared.registry_client import RegistryClient
from shared.wire import TidalError

log = get_logger("tidal.gpu_worker.catalog")


def model_record(cfg: ClusterConfig, inst: ModelInstance) -> ModelRecord:
    engine = inst.engine
    mcfg = engine.runner.cfg
    weights = engine.pool.bytes_of("weights")
    layer_bytes = engine.pool.bytes_of("weights", f"{mcfg.name}:layer0") if mcfg.num_layers else 0
    spec = cfg.model(inst.model)
    return ModelRecord(
        name=inst.model, path=str(spec.path), arch=mcfg.architecture[:64], dtype=spec.dtype,
        num_layers=mcfg.num_layers, max_context=inst.max_model_len, weight_bytes=weights, layer_bytes=layer_bytes,
    )


def unplaced_model_record(cfg: ClusterConfig, name: str) -> ModelRecord | None:
    """A catalog model's record from its config.json alone (no weights read); None if unreadable."""
    spec = cfg.model(name)
    try:
        mcfg = load_model_config(str(spec.path), spec.dtype)
    except (CheckpointError, OSError, ValueError, TypeError):
        return None
    weights, layer = model_weight_bytes(mcfg)
    return ModelRecord(name=name, path=str(spec.path), arch=mcfg.architecture[:64], dtype=spec.dtype,
                       num_layers=mcfg.num_layers, max_context=min(spec.max_context, mcfg.max_position),
                       weight_bytes=weights, layer_bytes=layer)


def _if_absent(record: Record) -> Any:
    return lambda current: record if current is None else None


def adapter_records(cfg: ClusterConfig, inst: ModelInstance) -> list[AdapterRecord]:
    out = []
    for name, adapter in sorted(inst.engine.runner.lora.host.items()):
        spec = cfg.adapter(name)
        targets = sorted({target for _layer, target in adapter.weights}) or list(spec.targets)
        out.append(AdapterRecord(name=name, base=inst.model, path=str(spec.path), rank=adapter.rank,
                                 targets=targets, bytes=adapter.nbytes))
    return out


def instance_record(worker_id: str, inst: ModelInstance, state: str) -> InstanceRecord:
    return InstanceRecord(
        instance_id=inst.instance_id, model=inst.model, worker_id=worker_id,
        layers=LayerRange(start=0, end=inst.num_layers), state=state,  # type: ignore[arg-type]
        adapters=sorted(inst.adapters),  # config and runtime-loaded (services/gpu_worker/adapter_ctl.py)
    )


def _unless_same(record: Record) -> Any:
    return lambda current: None if current == record else record


class CatalogWriter:
    """Build it before the engine threads start: the records are read from the engines once."""

    def __init__(self, registry: RegistryClient, cfg: ClusterConfig, worker_id: str, instances: list[ModelInstance]) -> None:
        self.registry = registry
        self.cfg = cfg
        self.worker_id = worker_id
        self.instances = list(instances)
        self.models = [model_record(cfg, inst) for inst in instances]
        self.adapters = [record for inst in instances for record in adapter_records(cfg, inst)]

    async def register(self) -> None:
        """Write the models, adapters and ready instances (raises on transport errors)."""
        for model in self.models:
            await self.registry.modify(Bucket.MODELS, model.name, _unless_same(model))
        for adapter in self.adapters:
            await self.registry.modify(Bucket.ADAPTERS, adapter.name, _unless_same(adapter))
        loaded = {m.name for m in self.models}
        for spec in self.cfg.models:
            record = None if spec.name in loaded else unplaced_model_record(self.cfg, spec.name)
            if record is not None:
                await self.registry.modify(Bucket.MODELS, spec.name, _if_absent(record))
        await self.set_state("ready")

    async def add(self, inst: ModelInstance) -> None:
        """A new instance (LoadModel): its model's record and its own, `ready` (retried until written)."""
        self.instances.append(inst)
        model = model_record(self.cfg, inst)
        backoff = 0.1
        while True:
            try:
                await self.registry.modify(Bucket.MODELS, model.name, _unless_same(model))
                await self.set_instance_state(inst, "ready")
                return
            except (TidalError, OSError) as exc:
                log.info("instance record not written yet; retrying", instance=inst.instance_id, error=str(exc))
                await asyncio.sleep(backoff)
                backoff = min(2.0, backoff * 2)

    async def set_instance_state(self, inst: ModelInstance, state: str) -> None:
        """One instance's record; `stopped` also drops it from the ones this writer keeps up to date."""
        if state == "stopped" and inst in self.instances:
            self.instances.remove(inst)
        record = instance_record(self.worker_id, inst, state)
        try:
            await self.registry.modify(Bucket.INSTANCES, inst.instance_id, _unless_same(record))
        except (TidalError, OSError) as exc:
            log.warning("instance state not written to the registry", instance=inst.instance_id, state=state,
                        error=repr(exc))

    async def register_until_done(self) -> None:
        """`register`, retried with backoff until a registry answers (it may start after us)."""
        backoff = 0.1
        while True:
            try:
                await self.register()
                log.info("instances registered", instances=[i.instance_id for i in self.instances])
                return
            except (TidalError, OSError) as exc:
                log.info("registry not reachable yet; retrying", error=str(exc), retry_in_s=backoff)
                await asyncio.sleep(backoff)
                backoff = min(2.0, backoff * 2)

    async def set_state(self, state: str) -> None:
        for inst in self.instances:
            record = instance_record(self.worker_id, inst, state)
            await self.registry.modify(Bucket.INSTANCES, inst.instance_id, _unless_same(record))
