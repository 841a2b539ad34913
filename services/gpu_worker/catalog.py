"""The worker's entries in the registry catalog: its models, their adapters, its instances.

A `ModelRecord` carries what the gateway needs to accept a request for the model without
loading it: `path` (the Hugging Face directory holding tokenizer.json and the chat template)
and `max_context` (the context the engine serves: the config's `max_context` capped by the
checkpoint's). Models and adapters are shared by every worker serving them: a worker writes
one only when it is absent or differs, with compare-and-set. `InstanceRecord`s are this
worker's own: `ready` once loaded, `draining` on SIGTERM, `stopped` at a clean exit.
"""
from __future__ import annotations

import asyncio
from typing import Any

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
        self.worker_id = worker_id
        self.instances = instances
        self.models = [model_record(cfg, inst) for inst in instances]
        self.adapters = [record for inst in instances for record in adapter_records(cfg, inst)]

    async def register(self) -> None:
        """Write the models, adapters and ready instances (raises on transport errors)."""
        for model in self.models:
            await self.registry.modify(Bucket.MODELS, model.name, _unless_same(model))
        for adapter in self.adapters:
            await self.registry.modify(Bucket.ADAPTERS, adapter.name, _unless_same(adapter))
        await self.set_state("ready")

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
