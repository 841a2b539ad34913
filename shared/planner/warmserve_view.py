"""WarmServe's reading of a ClusterView (pure): worker lifecycles, model demands, prewarm room, replicas.

* Lifecycle (§4, Fig. 5) from what a worker reports: an accepting instance makes it *dedicated*;
  only draining (evicted) instances: *grace*; no instance but warm weights: *universal*; else *idle*.
* Demand (Alg. 1's inputs) from a model's `Forecast`: arrival rates become concurrent requests
  by Little's law (`mean_request_s`), S = the bytes of the first `prewarm_fraction` of its layers
  (the embedding with them; norm and head when all), T_c = its whole weights at `load_bytes_per_s`.
* Room for prewarms on a worker: M = the pool less weights, workspace and adapters (what KV and
  prewarms share), less the Eq. 1 reservation target of each grace-period instance, less the warm
  bytes already there (Alg. 1 counts those as placed replicas).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from shared.events.predict import Forecast
from shared.events.registry import ModelRecord, WorkerLifecycle
from shared.planner.view import ClusterView, InstanceView, WorkerView
from shared.policy.warmserve import (
    Gpu, ModelDemand, PlacedReplica, PrewarmReplica, WorkerLife, WorkerRole, by_priority, concurrent_load,
    reservation_target,
)

SERVER = "local"  # one instance spans one worker here (D = 1): every worker is its own placement group


def lifecycle_of(worker: WorkerView) -> WorkerLife:
    accepting = sorted(i.model for i in worker.instances if i.accepting)
    if accepting:
        return WorkerLife(worker.worker_id, WorkerRole.DEDICATED, serving=accepting[0])
    warm = frozenset(m for m, b in worker.prewarmed.items() if b > 0)
    if worker.instances:
        draining = sorted(i.model for i in worker.instances)
        return WorkerLife(worker.worker_id, WorkerRole.DEDICATED, serving=draining[0], grace=True,
                          prewarmed=warm - {draining[0]})
    if warm:
        return WorkerLife(worker.worker_id, WorkerRole.UNIVERSAL, prewarmed=warm)
    return WorkerLife.idle(worker.worker_id)


def lifecycle_label(life: WorkerLife) -> WorkerLifecycle:
    """The registry's WorkerRecord.lifecycle: the role, with `grace` for a stopping dedicated worker."""
    return "grace" if life.grace else life.role.value  # type: ignore[return-value]


def current_forecasts(view: ClusterView, max_age_windows: float) -> dict[str, Forecast]:
    """Forecasts of catalog models whose window has not been over for more than `max_age_windows`."""
    return {m: f for m, f in sorted(view.forecasts.items())
            if m in view.models and view.now < f.window_start_ts + (1 + max_age_windows) * f.window_s}


def prewarm_layers(record: ModelRecord, fraction: float) -> int:
    return max(1, min(record.num_layers, math.ceil(record.num_layers * fraction)))


def prewarm_bytes(record: ModelRecord, layers: int) -> int:
    """First `layers` layers with the embedding (and norm + head when all): the worker's Prewarm."""
    if layers >= record.num_layers or not record.layer_bytes:
        return record.weight_bytes
    rest = max(0, record.weight_bytes - record.layer_bytes * record.num_layers)  # embedding, norm, head
    return record.layer_bytes * layers + rest  # an upper bound: the worker reads the embedding only


@dataclass(frozen=True)
class DemandSettings:
    batch_size: int  # B: concurrent requests one instance serves
    mean_request_s: float  # Little's law: rps -> concurrent requests
    load_bytes_per_s: float  # T_c = weight bytes / this
    prewarm_fraction: float  # of a model's layers a replica prewarms


def demand(record: ModelRecord, forecast: Forecast, active: int, s: DemandSettings) -> ModelDemand:
    return ModelDemand(
        model=record.name, size_bytes=prewarm_bytes(record, prewarm_layers(record, s.prewarm_fraction)), parallel=1,
        batch_size=s.batch_size, active=active, avg_load=concurrent_load(forecast.avg_rps, s.mean_request_s),
        peak_load=concurrent_load(forecast.peak_rps, s.mean_request_s),
        cold_start_s=record.weight_bytes / s.load_bytes_per_s if s.load_bytes_per_s > 0 else 0.0)


def kv_memory(worker: WorkerView) -> int:
    """M: what KV and prewarmed weights share on the worker (the pool less weights, workspace, adapters)."""
    b = worker.pool_bytes
    return max(0, worker.pool_capacity_bytes - b.get("weights", 0) - b.get("workspace", 0) - b.get("adapter", 0))


def grace_target(worker: WorkerView, inst: InstanceView, batch_size: int) -> int:
    """Eq. 1 for a grace-period instance: max(M·R/C, K + M/C), M the worker's KV memory, R its running
    requests (and waiting ones: they still need KV), K its KV in use, C the batch size."""
    return math.ceil(reservation_target(kv_memory(worker), batch_size, inst.running + inst.waiting, inst.kv_used_bytes))


def prewarm_room(worker: WorkerView, life: WorkerLife, batch_size: int) -> int:
    """Bytes free for new prewarms: 0 on a serving worker; else M less grace targets less warm bytes."""
    if life.role is WorkerRole.DEDICATED and not life.grace:
        return 0
    reserved = sum(grace_target(worker, i, batch_size) for i in worker.instances)
    return max(0, kv_memory(worker) - reserved - worker.pool_bytes.get("prewarm", 0))


def gpu_of(worker: WorkerView, life: WorkerLife, batch_size: int) -> Gpu:
    return Gpu(worker=worker.worker_id, server=SERVER, free_bytes=prewarm_room(worker, life, batch_size),
               role=life.role, grace=life.grace, serving=life.serving)


def existing_replicas(view: ClusterView, workers: list[WorkerView], full: dict[str, list[PrewarmReplica]],
                      pending: dict[tuple[str, str], int]) -> list[PlacedReplica]:
    """Warm weights already on workers (and prewarms under way, `pending`: (worker, model) -> bytes) as
    Alg. 1's placed replicas. A model's replicas take its demand's best scores in worker order; one
    beyond its demand (or of a model without a forecast) ranks lowest: the first to evict."""
    held: dict[str, list[tuple[str, int]]] = {}
    for w in workers:
        for model, nbytes in w.prewarmed.items():
            if nbytes > 0 and model in view.models:
                held.setdefault(model, []).append((w.worker_id, nbytes))
    for (worker, model), nbytes in pending.items():
        if model in view.models and all(w != worker for w, _ in held.get(model, [])):
            held.setdefault(model, []).append((worker, nbytes))
    out = []
    for model, places in sorted(held.items()):
        ranked = by_priority(full.get(model, []))
        for k, (worker, nbytes) in enumerate(sorted(places)):
            replica = ranked[k] if k < len(ranked) else PrewarmReplica(model, "burst", k, 0.0)
            out.append(PlacedReplica(replica, frozenset({worker}), nbytes))
    return out


__all__ = [
    "DemandSettings", "current_forecasts", "demand", "existing_replicas", "gpu_of", "grace_target",
    "kv_memory", "lifecycle_label", "lifecycle_of", "prewarm_bytes", "prewarm_layers", "prewarm_room",
]
