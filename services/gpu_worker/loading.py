"""Build a worker's model instances from the cluster config.

One `LLMEngine` per model the worker's `[[workers]]` entry lists. Each engine has its own
memory pool, and the worker's `memory` is split evenly between them (decision: pools are
per engine today, so two models cannot borrow each other's free KV; the split keeps every
byte attributable and the pressure reproducible). Within an instance the pool holds its
weights, workspace, resident adapters, and KV takes the rest.

Every adapter of a served model is registered in its engine's host store (so a request may
name it), and the adapters the worker lists are made resident on the device at start.
"""
from __future__ import annotations

import os
import re
from pathlib import Path

from services.gpu_worker.engine.engine import EngineConfig, LLMEngine
from services.gpu_worker.engine.model_config import CheckpointError
from services.gpu_worker.instance import ModelInstance
from shared.config import ClusterConfig, ModelSpec, WorkerSpec
from shared.logging import get_logger

log = get_logger("tidal.gpu_worker.loading")

_UNSAFE = re.compile(r"[^A-Za-z0-9_-]")


class LoadError(RuntimeError):
    """A model or adapter cannot be served by this worker; the message says which and why."""


def instance_id(worker_id: str, model: str) -> str:
    """The instance of `model` on `worker_id`: token-safe, <= 64 chars."""
    return f"{worker_id}-{_UNSAFE.sub('_', model)}"[:64]


def default_threads(cfg: ClusterConfig, worker: WorkerSpec) -> int:
    """torch threads for a CPU worker: the host's cores less one (the gateway, dispatcher, NATS
    and the workers' event loops need it), shared between the config's CPU workers.

    Oversubscribing is far worse than leaving a core idle: OpenMP threads spin-wait, and on a
    busy 2-core host an engine with 2 threads measured 4x slower per step than with 1.
    `TIDAL_WORKER_THREADS` (or `--threads`) overrides.
    """
    env = os.environ.get("TIDAL_WORKER_THREADS")
    if env:
        return max(1, int(env))
    if worker.device != "cpu":
        return 1  # the host side of a GPU worker only launches kernels
    cpu_workers = sum(1 for w in cfg.workers if w.device == "cpu") or 1
    return max(1, ((os.cpu_count() or 1) - 1) // cpu_workers)


def engine_config(cfg: ClusterConfig, worker: WorkerSpec, model: ModelSpec, pool_bytes: int, threads: int) -> EngineConfig:
    pol = cfg.policies
    return EngineConfig(
        model_dir=str(model.path), pool_bytes=pool_bytes, block_size=pol.kv_block_tokens,
        max_num_seqs=pol.max_batch_size, max_num_batched_tokens=max(pol.step_token_budget, pol.max_batch_size),
        max_model_len=model.max_context, dtype=model.dtype, device=worker.device, lora_mode=pol.lora_kernel,
        num_threads=threads,
    )


def load_instances(cfg: ClusterConfig, worker: WorkerSpec, *, threads: int | None = None) -> list[ModelInstance]:
    """Load every model of `worker` (blocking: call it off the event loop). Raises LoadError."""
    if not worker.models:
        return []
    threads = threads or default_threads(cfg, worker)
    pool_bytes = int(worker.memory) // len(worker.models)
    instances = []
    for name in worker.models:
        model = cfg.model(name)
        if not model.path or not (Path(model.path) / "config.json").is_file():
            hint = " (a demo model: run `tidal up`, which generates it, or `tidal make-model`)" if model.demo else ""
            raise LoadError(f"model {name!r}: no checkpoint at {model.path}{hint}")
        try:
            engine = LLMEngine(engine_config(cfg, worker, model, pool_bytes, threads))
        except (CheckpointError, MemoryError, ValueError, OSError) as exc:
            raise LoadError(f"model {name!r} from {model.path} ({pool_bytes} B of the worker's pool): {exc}") from exc
        if engine.tokenizer is None:
            raise LoadError(f"model {name!r}: {model.path} has no tokenizer.json (the gateway tokenizes with it)")
        for adapter in cfg.adapters:
            if adapter.base != name:
                continue
            try:
                engine.add_lora(adapter.name, str(adapter.path))
                if adapter.name in worker.adapters:
                    engine.runner.lora.ensure_resident([adapter.name])
            except (CheckpointError, MemoryError, ValueError, OSError) as exc:
                raise LoadError(f"adapter {adapter.name!r} of {name!r} from {adapter.path}: {exc}") from exc
        engine.blocks.sync_with_pool()  # KV takes what the adapters left
        inst = ModelInstance(instance_id(worker.id, name), name, engine, worker.id,
                             stream_interval_s=float(worker.stream_interval))
        log.info("model instance loaded", instance=inst.instance_id, model=name, pool_bytes=pool_bytes,
                 kv_blocks=engine.blocks.num_blocks, adapters=sorted(inst.adapters), threads=threads)
        instances.append(inst)
    return instances
