"""WarmServe's replica counts and scores (Eqs. 5-8) and the reservation target (Eq. 1); pure.

Loads are in the unit of the batch size: concurrent requests. A forecast of arrival rates
(`Forecast.avg_rps`) becomes one with `concurrent_load(rps, mean_request_s)` (Little's law).
Where the paper is silent: Eq. 8's burstiness factor (L_P - L_A) / L_A takes L_A as at least
one request (a model with no average load would otherwise score infinity); a replica's
priority is (basic before burst, then score), the paper's "basic replicas always have higher
priorities than burst replicas, regardless of their scores".
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

ReplicaKind = Literal["basic", "burst"]


@dataclass(frozen=True)
class ModelDemand:
    """One model's inputs to Alg. 1 (the paper's S_i, D_i, B_i, K_i, L_A, L_P, T_c)."""

    model: str
    size_bytes: int  # S: the bytes a replica prewarms over all its GPUs (whole weights, or the first layers)
    parallel: int  # D: GPUs one instance spans
    batch_size: int  # B: concurrent requests one instance serves
    active: int  # K: running instances
    avg_load: float  # L_A: forecast average concurrent requests
    peak_load: float  # L_P: forecast peak concurrent requests
    cold_start_s: float  # T_c: loading the whole weights into GPUs (profiled)

    def __post_init__(self) -> None:
        if self.size_bytes < 0 or self.parallel < 1 or self.batch_size < 1 or self.active < 0:
            raise ValueError(f"{self.model}: need size_bytes >= 0, parallel >= 1, batch_size >= 1, active >= 0")
        if not (self.avg_load >= 0 and self.peak_load >= 0 and self.cold_start_s >= 0):
            raise ValueError(f"{self.model}: loads and cold_start_s must be >= 0 (and not NaN)")

    @property
    def bytes_per_gpu(self) -> int:
        return -(-self.size_bytes // self.parallel)  # S / D, rounded up: a GPU holds whole bytes


@dataclass(frozen=True)
class PrewarmReplica:
    model: str
    kind: ReplicaKind
    rank: int  # i: zero-based rank within its kind
    score: float

    @property
    def priority(self) -> tuple[int, float]:
        """Larger is more important: every basic replica before every burst one, then the score."""
        return (1 if self.kind == "basic" else 0, self.score)


def concurrent_load(rps: float, mean_request_s: float) -> float:
    """Little's law: requests in flight = arrival rate x mean time in the system."""
    if rps < 0 or mean_request_s < 0:
        raise ValueError(f"rps and mean_request_s must be >= 0, got {rps} and {mean_request_s}")
    return rps * mean_request_s


def replica_counts(d: ModelDemand) -> tuple[int, int]:
    """(N_basic, N_burst): Eq. 5 max(ceil(L_A/B) - K, 0); Eq. 6 max(ceil(L_P/B) - N_basic - K, 0)."""
    basic = max(math.ceil(d.avg_load / d.batch_size) - d.active, 0)
    burst = max(math.ceil(d.peak_load / d.batch_size) - basic - d.active, 0)
    return basic, burst


def burstiness(d: ModelDemand) -> float:
    """(L_P - L_A) / L_A of Eq. 8, with L_A taken as at least one request."""
    return max(d.peak_load - d.avg_load, 0.0) / max(d.avg_load, 1.0)


def prewarm_replicas(d: ModelDemand) -> list[PrewarmReplica]:
    """The model's replicas to prewarm with their scores: Eq. 7 (basic) and Eq. 8 (burst)."""
    basic, burst = replica_counts(d)
    total = basic + burst
    out = [PrewarmReplica(d.model, "basic", i, math.exp(-i / total) * d.cold_start_s) for i in range(basic)]
    out += [PrewarmReplica(d.model, "burst", i, math.exp(-(basic + i) / total) * d.cold_start_s * burstiness(d))
            for i in range(burst)]
    return out


def by_priority(replicas: list[PrewarmReplica]) -> list[PrewarmReplica]:
    """Alg. 1's order: basic first, each kind by descending score (ties: model, rank)."""
    return sorted(replicas, key=lambda r: (-r.priority[0], -r.priority[1], r.model, r.rank))


def reservation_target(kv_capacity: float, max_batch: int, running: int, kv_used: float) -> float:
    """Eq. 1: max(M R / C, K + M / C) -- the KV a grace-period instance keeps for its requests."""
    if kv_capacity < 0 or max_batch < 1 or running < 0 or kv_used < 0:
        raise ValueError("need kv_capacity >= 0, max_batch >= 1, running >= 0, kv_used >= 0")
    return max(kv_capacity * running / max_batch, kv_used + kv_capacity / max_batch)


def prewarm_room(kv_capacity: float, max_batch: int, running: int, kv_used: float, kv_reserved: float) -> float:
    """What a grace-period instance gives up for other models' weights: its reserved KV above the target."""
    return max(0.0, kv_reserved - reservation_target(kv_capacity, max_batch, running, kv_used))


__all__ = [
    "ModelDemand", "PrewarmReplica", "ReplicaKind", "burstiness", "by_priority", "concurrent_load",
    "prewarm_replicas", "prewarm_room", "replica_counts", "reservation_target",
]
