"""WarmServe's autoscaling and prewarming policy (pure: no I/O, no clock). One import for the planner:

    counts = replica_counts(demand)                 # Eqs. 5-6: basic and burst replicas to prewarm
    replicas = prewarm_replicas(demand)             # Eqs. 7-8: their prewarming scores
    target = reservation_target(M, C, R, K)         # Eq. 1: the KV a grace-period instance keeps
    plan = place(demands, gpus, existing)           # Alg. 1: evict-aware placement of the replicas
    pick = scale_up_target(model, existing)         # which prewarmed replica a scale-up dedicates
    life = WorkerLife.idle("w0").prewarm("llama")   # the worker lifecycle idle / universal / dedicated

Modules: warmserve_replicas (Eqs. 1, 5-8), warmserve_placement (Alg. 1), warmserve_lifecycle,
warmserve_predictor (the load forecast, Eqs. 2-4). docs/warmserve.md has the details.
"""
from __future__ import annotations

from shared.policy.warmserve_lifecycle import LifecycleError, WorkerLife, WorkerRole
from shared.policy.warmserve_placement import Gpu, PlacedReplica, PlacementPlan, ScaleUp, place, scale_up_target
from shared.policy.warmserve_replicas import (
    ModelDemand, PrewarmReplica, ReplicaKind, burstiness, by_priority, concurrent_load, prewarm_replicas,
    prewarm_room, replica_counts, reservation_target,
)

__all__ = [
    "Gpu", "LifecycleError", "ModelDemand", "PlacedReplica", "PlacementPlan", "PrewarmReplica", "ReplicaKind",
    "ScaleUp", "WorkerLife", "WorkerRole", "burstiness", "by_priority", "concurrent_load", "place",
    "prewarm_replicas", "prewarm_room", "replica_counts", "reservation_target", "scale_up_target",
]
