"""State of the fleet simulator: GPUs, prewarmed replicas, instances, and the systems compared.

A GPU is free (idle or universal: it may hold prewarmed replicas) or belongs to exactly one
instance (dedicated; in its grace period while the instance drains). A replica is one model's
weights on a set of GPUs, complete at `ready_at` (loads run over each GPU's host link, one
at a time). An instance is a SimWorker engine on its GPUs, serving from `ready_at`.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, Protocol

from loadgen.sim.fleet_profile import FleetModel, FleetProfile
from loadgen.sim.worker import SimWorker
from shared.policy.warmserve import PlacedReplica
from shared.policy.warmserve_predictor import LoadForecast

Prewarm = Literal["none", "reactive", "proactive"]


@dataclass(frozen=True)
class StaticInstance:
    """A pre-created instance (MuxServe-like co-location): its GPUs, TP degree, compute share, KV."""

    model: str
    gpus: tuple[int, ...]
    share: float  # fraction of the GPUs' compute (spatial sharing)
    kv_blocks: int
    max_batch: int


@dataclass(frozen=True)
class FleetSystem:
    name: str
    autoscale: bool = True
    cache_on_release: bool = True  # a stopped instance's weights stay on its GPUs (SLLM-GPU, WarmServe)
    prewarm: Prewarm = "none"  # WarmServe: reactive = idle/universal GPUs only; proactive = also grace-period ones
    engine_pool: bool = True  # WarmServe §6: pre-created engines; without, every start pays engine_init_s
    keep_alive_s: float = 30.0  # an instance above the need this long enters its grace period
    tick_s: float = 1.0  # autoscaler and prewarm planner period
    static: tuple[StaticInstance, ...] = ()  # instances created before the trace starts (no autoscaling)


@dataclass(eq=False)
class Replica:
    model: str
    gpus: tuple[int, ...]
    bytes_per_gpu: int
    ready_at: float  # the load completes then (<= now: prewarmed)
    proactive: bool = False  # loaded into a grace-period instance's KV surplus
    placed: PlacedReplica | None = None  # the policy's view (score) from the last planning round

    def loaded(self, now: float) -> bool:
        return self.ready_at <= now


@dataclass(eq=False)
class Instance:
    id: int
    model: str
    gpus: tuple[int, ...]
    engine: SimWorker
    ready_at: float
    start: str  # "initial", "hit", "partial", "cold", "static"
    grace: bool = False
    outstanding: int = 0  # requests sent to the engine and not finished
    kv_lent_blocks: int = 0  # KV blocks lent to proactive prewarms (engine.total shrank by this)
    kv_blocks: int = 0  # the engine's KV blocks before any lending

    def ready(self, now: float) -> bool:
        return self.ready_at <= now


@dataclass(eq=False)
class GpuState:
    index: int
    server: int
    instance: Instance | None = None
    replicas: list[Replica] = field(default_factory=list)

    @property
    def worker(self) -> str:
        return f"g{self.index:02d}"

    def held_bytes(self) -> int:
        return sum(r.bytes_per_gpu for r in self.replicas)

    def link_free(self, now: float) -> float:
        """Loads on one GPU's host link run one after another."""
        return max([now] + [r.ready_at for r in self.replicas])


class FleetControl(Protocol):
    """What scale-up (fleet_scaling.py) and the prewarm planner (fleet_prewarm.py) read and change
    of the fleet simulator (FleetSim implements it), so neither imports the simulator."""

    profile: FleetProfile
    system: FleetSystem
    models: dict[str, FleetModel]
    gpus: list[GpuState]
    instances: dict[str, list[Instance]]
    replicas: list[Replica]
    forecasts: dict[str, list[LoadForecast]]
    window: int
    dirty: bool
    prewarms: int
    proactive: int

    def dedicate(self, model: str, gpus: tuple[int, ...], ready_at: float, start: str) -> Instance: ...

    def ungrace(self, inst: Instance) -> None: ...

    def evict(self, replica: Replica) -> None: ...

    def add_replica(self, replica: Replica) -> None: ...
