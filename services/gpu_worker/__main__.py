"""`python -m services.gpu_worker --worker-id ID`: one worker per device.

Start-up: announce the WorkerRecord and send heartbeats (state `starting`), bind the
assignment/abort/control subjects, then load the models the config assigns to this worker
(off the event loop; demo checkpoints are generated first if missing, the CPU attention kernel
built if `tidal up` did not; health answers `starting` with what it is doing), start one engine
thread per instance, register models/adapters/instances in the registry (retried until
one answers) and become `ready`. SIGTERM drains (see services.gpu_worker.worker).
"""
from __future__ import annotations

import argparse
import asyncio
import os

from gpu_ext import cpu_attention
from services.gpu_worker.catalog import CatalogWriter
from services.gpu_worker.demo_assets import AssetError, ensure_demo_assets
from services.gpu_worker.engine.memory_pool import MemoryPool
from services.gpu_worker.loading import LoadError, default_threads, load_instances
from services.gpu_worker.model_ctl import ModelControl
from services.gpu_worker.worker import GpuWorker
from shared.bootstrap import bootstrap, fail
from shared.logging import get_logger
from shared.registry_client import RegistryClient
from shared.service import Service, run

log = get_logger("tidal.gpu_worker")


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m services.gpu_worker")
    parser.add_argument("--worker-id", default=os.environ.get("TIDAL_WORKER_ID"),
                        help="which [[workers]] entry of the cluster config this process is [TIDAL_WORKER_ID]")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch threads for the engines (default: the host's cores / CPU workers in the config) "
                             "[TIDAL_WORKER_THREADS]")
    parser.add_argument("--stats-interval", type=float, default=0.25, help="seconds between WorkerStats")
    boot = bootstrap("gpu_worker", parser=parser)
    worker_id = boot.args.worker_id
    known = [w.id for w in boot.config.workers]
    if not worker_id:
        fail(f"--worker-id is required (workers in the config: {', '.join(known) or 'none'})")
    if worker_id not in known:
        fail(f"unknown worker id {worker_id!r} (workers in the config: {', '.join(known) or 'none'})")
    spec = boot.config.worker(worker_id)
    cfg = boot.config
    threads = boot.args.threads or default_threads(cfg, spec)
    worker = GpuWorker(boot.service, worker_id, spec.device, stats_interval=boot.args.stats_interval,
                       max_waiting=4 * cfg.policies.max_batch_size)
    pool = MemoryPool(int(spec.memory), spec.device)  # the device's one pool: every instance, warm weights too
    worker.model_ctl = ModelControl(worker, cfg, spec, pool, threads)  # LoadModel / EvictModel / Prewarm
    worker.group_ctl.set_dead_after(float(cfg.registry.dead_after))  # a buddy-group member silent this long is lost
    worker.announcer = boot.announce(worker=spec)  # it publishes the worker's data-plane address
    boot.service.add_actor(worker)

    async def load_and_serve(service: Service) -> None:
        def report(what: str) -> None:  # answered on health while starting (`tidal up` prints it)
            service.progress = what
            log.info("starting", progress=what)

        def load() -> list:
            report("checking demo checkpoints")
            ensure_demo_assets(cfg, models=spec.models)
            if spec.device == "cpu" and spec.models and cpu_attention.pending():
                # `make install` / `tidal up` build it ahead of time; a bare `pip install` gets it here, once
                report("building the CPU attention kernel (once per venv; a minute on a busy box)")
                cpu_attention.paged_decode_kernel()
            return load_instances(cfg, spec, threads=threads, pool=pool, progress=report)

        try:
            instances = await asyncio.to_thread(load)
        except (LoadError, AssetError) as exc:
            log.error("cannot load this worker's models", error=str(exc))
            raise
        catalog = CatalogWriter(RegistryClient(service.bus, timeout=2.0), cfg, worker_id, instances)
        await worker.activate(instances, catalog=catalog)

    boot.service.on_start.append(load_and_serve)
    boot.service.on_drain.append(worker.drain)
    run(boot.service)


if __name__ == "__main__":
    main()
