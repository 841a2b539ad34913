"""The KV-packing fleet's state (loadgen/sim/kv_packing_fleet.py): request states, a simulated
device, a copy in flight, MELL §V's budgets and the result."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from loadgen.sim.kv_packing import PackingResult

FUTURE, RUNNING, QUEUED, DONE = 0, 1, 2, 3
INF = float("inf")


@dataclass(frozen=True)
class Budgets:
    """MELL §V's boundaries, per second of a planning interval (adaptive migration)."""

    link_bytes_per_s: float  # one device's network interface, each direction (communication boundary)
    prefill_tokens_per_s: float  # a destination's compute spare for re-prefill (computation boundary)

    def __post_init__(self) -> None:
        if self.link_bytes_per_s < 0 or self.prefill_tokens_per_s < 0:
            raise ValueError(f"budgets must be >= 0, got {self.link_bytes_per_s}, {self.prefill_tokens_per_s}")


@dataclass(frozen=True)
class FleetResult(PackingResult):
    used_bytes: np.ndarray | None = None  # per epoch: the granules of the running requests (for utilisation)
    requests: int = 0
    decided: int = 0  # moves the policy decided (after batching)
    removed_by_batching: int = 0  # moves the policy's batches dropped
    capped_ops: int = 0  # MELL operations that stopped at the migration cap
    kv_migrations: int = 0  # handed over
    token_migrations: int = 0
    deferred: int = 0  # move-intervals the boundaries deferred
    requeued: int = 0  # moves of requests waiting for memory (free)
    preemptions: int = 0
    held_back: int = 0  # arrivals that waited for memory on the device they were put on
    ttft_delay: np.ndarray | None = None  # per request: seconds added before its first token
    tpot_delay: np.ndarray | None = None  # per request: seconds added after it, per later token
    max_moves_per_round: int = 0  # LB: the most migrations one balancing round decided
    active_physical: np.ndarray | None = None  # per epoch: active GPUs counting those a copy or a wait holds
    max_items_per_op: int = -1  # per_op: the most items one operation moved (a multi-item counts once)
    refused: int = 0  # arrival-intervals a full pool refused (`pool`)
    aborted: bool = False  # stopped early: so many requests were past a target of `abort_late` that the SLO is missed

    def peak_physical(self) -> int:
        return int(self.active_physical.max(initial=0)) if self.active_physical is not None else self.peak_devices()

    @property
    def migrations(self) -> int:
        """Migrations carried out (KV hand-overs and token moves)."""
        return self.kv_migrations + self.token_migrations


class Device:
    __slots__ = ("running", "queue", "incoming", "out", "ub", "nic_out", "nic_in", "prefill_busy")

    def __init__(self) -> None:
        self.running: set[int] = set()
        self.queue: list[int] = []  # waiting for memory, by arrival order
        self.incoming: set[int] = set()  # copies reserving blocks here
        self.out: set[int] = set()  # copies leaving (still here until the hand-over)
        self.ub = 0  # running + incoming requests' granules in whole blocks: an upper bound of the blocks held
        self.nic_out = self.nic_in = 0.0  # when this device's interface is free again, each way
        self.prefill_busy = 0.0  # when its re-prefills queued so far are done

    def empty(self) -> bool:
        return not (self.running or self.queue or self.incoming)


@dataclass
class Flight:
    request: int
    source: str
    destination: str
    done_s: float
    ok: bool
    stall_s: float
    reason: str = ""


__all__ = ["DONE", "FUTURE", "INF", "QUEUED", "RUNNING", "Budgets", "Device", "FleetResult", "Flight"]
