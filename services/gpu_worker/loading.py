"""Build a worker's model instances from the cluster config.

One `LLMEngine` per model the worker's `[[workers]]` entry lists, all on ONE memory pool of
the worker's `memory` (one pool per device): every instance charges its weights, workspace
and resident adapters to it under its instance id, and KV takes the rest — each instance's
KV grows and shrinks with its load, claiming free bytes and other instances' free blocks
(never live ones; see `engine/block_manager.py`).

Every adapter of a served model is registered in its engine's host store (so a request may
name it), and the adapters the worker lists are made resident on the device at start.
"""
from __future__ import annotations

import os
import re
from collections.abc import Callable
from pathlib import Path

from services.gpu_worker.engine.engine import EngineConfig, LLMEngine
from services.gpu_worker.engine.memory_pool import MemoryPool
from services.gpu_worker.engine.model_config import CheckpointError
from services.gpu_worker.engine.preloaded import PreloadedWeights
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
        scheduling_policy=pol.scheduling,
        num_threads=threads, cpu_lora_assist=pol.cpu_lora_assist, cpu_lora_processes=worker.cpu_lora_processes,
        lora_load_bandwidth=worker.lora_load_bandwidth,
        lora_load_mode="auto",  # per cold request: CPU assist, async or inline load by T_cpu < X + P (cold_start.py)
        prefix_caching=pol.prefix_caching, model_name=model.name,
    )


def load_instances(cfg: ClusterConfig, worker: WorkerSpec, *, threads: int | None = None,
                   pool: MemoryPool | None = None, progress: Callable[[str], None] | None = None,
                   ) -> list[ModelInstance]:
    """Load every model of `worker` (blocking: call it off the event loop) on `pool` (default: a
    new pool of the worker's `memory`); `progress` hears "loading <model> (i/n)" before each. Raises LoadError."""
    if not worker.models:
        return []
    threads = threads or default_threads(cfg, worker)
    pool = pool if pool is not None else MemoryPool(int(worker.memory), worker.device)  # shared by every instance
    loaded = []
    for i, name in enumerate(worker.models, 1):
        if progress is not None:
            progress(f"loading {name} ({i}/{len(worker.models)})")
        loaded.append(load_instance(cfg, worker, name, pool, threads))
    return loaded


def load_instance(cfg: ClusterConfig, worker: WorkerSpec, name: str, pool: MemoryPool, threads: int, *,
                  instance: str | None = None, preloaded: PreloadedWeights | None = None,
                  background_load: bool = False) -> ModelInstance:
    """One instance of catalog model `name` on the worker's pool (blocking). `preloaded`: its warm
    weights (services/gpu_worker/prewarm.py), used without a copy; `background_load`: the layers not
    preloaded load while it serves. Raises LoadError."""
    pool_bytes = pool.capacity_bytes
    model = cfg.model(name)
    if not model.path or not (Path(model.path) / "config.json").is_file():
        hint = " (a demo model: run `tidal up`, which generates it, or `tidal make-model`)" if model.demo else ""
        raise LoadError(f"model {name!r}: no checkpoint at {model.path}{hint}")
    tenant = instance or instance_id(worker.id, name)
    try:
        engine = LLMEngine(engine_config(cfg, worker, model, pool_bytes, threads), pool, tenant=tenant,
                           preloaded=preloaded, background_load=background_load)
    except (CheckpointError, MemoryError, ValueError, OSError) as exc:
        pool.release_tenant(tenant)  # what it charged before failing
        raise LoadError(f"model {name!r} from {model.path} ({pool.free_bytes} B left of the worker's pool of "
                        f"{pool_bytes} B): {exc}") from exc
    if engine.tokenizer is None:
        pool.release_tenant(tenant)
        raise LoadError(f"model {name!r}: {model.path} has no tokenizer.json (the gateway tokenizes with it)")
    engine.runner.lora.set_host_limit(worker.lora_host_memory)  # None: unbounded
    for adapter in cfg.adapters:
        if adapter.base != name:
            continue
        try:
            engine.add_lora(adapter.name, str(adapter.path))
            if adapter.name in worker.adapters:
                engine.runner.lora.ensure_resident([adapter.name])
        except (CheckpointError, MemoryError, ValueError, OSError) as exc:
            pool.release_tenant(tenant)
            raise LoadError(f"adapter {adapter.name!r} of {name!r} from {adapter.path}: {exc}") from exc
    engine.blocks.sync_with_pool()  # KV takes what the adapters left
    if any(a.base == name for a in cfg.adapters):
        engine.cold.start_helpers(wait=True)  # CPU LoRA helpers (assist on, loads beside the steps); else on first use
    if engine.runner.loading is not None:
        engine.runner.loading.start()  # the layers not preloaded arrive while it serves
    inst = ModelInstance(tenant, name, engine, worker.id, stream_interval_s=float(worker.stream_interval),
                         min_step_s=float(worker.min_step_time))
    log.info("model instance loaded", instance=inst.instance_id, model=name, pool_bytes=pool_bytes,
             pool_free=pool.free_bytes, kv_blocks=engine.blocks.num_blocks, adapters=sorted(inst.adapters),
             threads=threads, preloaded_layers=len(preloaded.layers) if preloaded is not None else 0,
             loading_layers=len(engine.runner.loading.pending) if engine.runner.loading is not None else 0)
    return inst
