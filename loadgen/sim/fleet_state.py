"""State of the fleet simulator: GPUs, prewarmed replicas, instances, and the systems compared.

A GPU is free (idle or universal: it may hold prewarmed replicas) or belongs to exactly one
instance (dedicated; in its grace period while the stopped instance drains). A replica is one
model's weights on a set of GPUs, complete at `ready_at` (loads run over each GPU's host link, one
at a time), charged to those GPUs' memory as prewarm. An instance is a SimWorker engine on its
GPUs, serving from `ready_at`; requests the autoscaler sends it earlier wait for it (`pending`).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, Protocol

from loadgen.sim.fleet_profile import FleetModel, FleetProfile
from loadgen.sim.request import SimRequest
from loadgen.sim.worker import SimWorker
from shared.policy.autoscaler import AutoscaleParams
from shared.policy.warmserve import PlacedReplica
from shared.policy.warmserve_predictor import LoadForecast

Prewarm = Literal["none", "reactive", "proactive"]
# Where a started instance's weights came from: a complete replica on its GPUs ("gpu": a prewarm hit),
# a replica still loading ("partial": the rest over the host link), host memory ("host") or storage
# first ("storage": checkpoints not in host memory).
START_SOURCES = ("gpu", "partial", "host", "storage")
# How a replica got onto its GPUs: Alg. 1 onto idle/universal GPUs ("placed"), into a grace-period
# instance's KV ("proactive"), or left by an instance that stopped ("kept").
ORIGINS = ("placed", "proactive", "kept")


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
    autoscale: bool = True  # the public code's autoscaler (shared/policy/autoscaler.py)
    # A stopped instance's weights stay on its GPUs as a prewarmed replica (charged to their memory as
    # prewarm, evicted by the next instance there; WarmServe's prewarm planner scores it like any
    # replica). False: they are freed when it stops.
    keep_weights: bool = True
    prewarm: Prewarm = "none"  # WarmServe: reactive = idle/universal GPUs only; proactive = also grace-period ones
    engine_pool: bool = True  # pre-created engines (§6); without, every start pays engine_init_s
    scaler: AutoscaleParams = AutoscaleParams()
    static: tuple[StaticInstance, ...] = ()  # instances created before the trace starts (no autoscaling)


@dataclass(eq=False)
class Replica:
    model: str
    gpus: tuple[int, ...]
    bytes_per_gpu: int
    ready_at: float  # the load completes then (<= now: prewarmed)
    origin: str = "placed"  # one of ORIGINS
    proactive: bool = False  # in a grace-period instance's lent KV (until that instance ends)
    placed: PlacedReplica | None = None  # the policy's view (score) from the last planning round

    def loaded(self, now: float) -> bool:
        return self.ready_at <= now


@dataclass(eq=False)
class Instance:
    id: int
    model: str
    gpus: tuple[int, ...]
    engine: SimWorker
    ready_at: float  # serves from then
    source: str  # one of START_SOURCES, or "initial" / "static"
    started_at: float = 0.0  # when the start was decided (the autoscaler's protect period)
    weights_at: float = 0.0  # its weights are all on its GPUs then
    origin: str = ""  # a "gpu" start: the replica's origin
    cap: int = 32  # requests the dispatcher gives it at once
    grace: bool = False  # stopped: no new requests, ends when it has none
    outstanding: int = 0  # requests sent to it and not finished (pending included)
    pending: list[SimRequest] = field(default_factory=list)  # sent before it was ready
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

    def dedicate(self, model: str, gpus: tuple[int, ...], now: float, ready_at: float, weights_at: float,
                 source: str, origin: str = "") -> Instance: ...

    def evict(self, replica: Replica) -> None: ...

    def add_replica(self, replica: Replica) -> None: ...
