"""One memory pool per device: every byte charged to one kind and one owner.

The pool is pure accounting (no torch): it decides whether bytes may be used and by
whom; the runner and gpu_ext own the actual storage. KV takes what is left: the block
manager claims free pool bytes as blocks (`BlockManager.sync_with_pool`) and registers
itself as the KV reclaimer, so a charge that finds the pool short asks KV to give back
FREE blocks (never live ones) before refusing. See DESIGN "the memory economy".
"""
from __future__ import annotations

import enum
import itertools
from collections.abc import Callable
from dataclasses import dataclass


class MemoryKind(str, enum.Enum):
    WEIGHTS = "weights"  # the served model's weights (owner names the layer or part)
    PREWARM = "prewarm"  # weights of another model kept warm (WarmServe)
    LORA = "lora"  # LoRA adapters loaded on the device
    KV = "kv"  # KV blocks, used and free
    WORKSPACE = "workspace"  # activations, sampler buffers, graphs


class PoolExhausted(MemoryError):
    """A charge does not fit; the message says how much was asked and what holds the rest."""


@dataclass(frozen=True, slots=True)
class ChargeHandle:
    charge_id: int
    kind: MemoryKind
    owner: str


@dataclass(slots=True)
class _Charge:
    kind: MemoryKind
    owner: str
    nbytes: int


# Called with the number of bytes still missing; gives back what it can (bytes given).
Reclaimer = Callable[[int], int]


class MemoryPool:
    def __init__(self, capacity_bytes: int, device: str = "cpu") -> None:
        if capacity_bytes < 0:
            raise ValueError(f"pool capacity must be >= 0 bytes, got {capacity_bytes}")
        self.device = device
        self._capacity = int(capacity_bytes)
        self._charges: dict[int, _Charge] = {}
        self._ids = itertools.count(1)
        self._used = 0
        self._reclaimers: dict[MemoryKind, Reclaimer] = {}

    # --- totals --------------------------------------------------------------------
    @property
    def capacity_bytes(self) -> int:
        return self._capacity

    @property
    def used_bytes(self) -> int:
        return self._used

    @property
    def free_bytes(self) -> int:
        return self._capacity - self._used

    def set_capacity(self, capacity_bytes: int) -> None:
        """The device's usable bytes changed (e.g. free HBM); refuses to go below what is charged."""
        if capacity_bytes < self._used:
            raise PoolExhausted(
                f"cannot set pool capacity to {capacity_bytes} B: {self._used} B are charged ({self.breakdown()})"
            )
        self._capacity = int(capacity_bytes)

    # --- charging ------------------------------------------------------------------
    def register_reclaimer(self, kind: MemoryKind, reclaimer: Reclaimer) -> None:
        """`reclaimer(missing_bytes)` releases some of `kind`'s unused bytes on demand."""
        self._reclaimers[kind] = reclaimer

    def _make_room(self, nbytes: int, exclude: MemoryKind | None) -> None:
        for kind, reclaim in list(self._reclaimers.items()):
            if self.free_bytes >= nbytes:
                return
            if kind is not exclude:
                reclaim(nbytes - self.free_bytes)

    def charge(self, kind: MemoryKind, owner: str, nbytes: int, *, reclaim: bool = True) -> ChargeHandle:
        """Charge `nbytes` to (kind, owner); refuse with PoolExhausted if they cannot fit."""
        kind = MemoryKind(kind)
        if nbytes < 0:
            raise ValueError(f"charge for {kind.value}/{owner}: nbytes must be >= 0, got {nbytes}")
        if nbytes > self.free_bytes and reclaim:
            self._make_room(nbytes, exclude=kind)
        if nbytes > self.free_bytes:
            raise PoolExhausted(
                f"{self.device} pool: cannot charge {nbytes} B to {kind.value}/{owner}: "
                f"{self.free_bytes} B free of {self._capacity} B; in use: {self.breakdown()}"
            )
        charge_id = next(self._ids)
        self._charges[charge_id] = _Charge(kind, owner, int(nbytes))
        self._used += int(nbytes)
        return ChargeHandle(charge_id, kind, owner)

    def resize(self, handle: ChargeHandle, nbytes: int, *, reclaim: bool = True) -> None:
        """Grow or shrink an existing charge in place (KV uses this as blocks come and go)."""
        charge = self._get(handle)
        delta = int(nbytes) - charge.nbytes
        if delta > self.free_bytes and reclaim:
            self._make_room(delta, exclude=charge.kind)
        if delta > self.free_bytes:
            raise PoolExhausted(
                f"{self.device} pool: cannot grow {charge.kind.value}/{charge.owner} by {delta} B: "
                f"{self.free_bytes} B free; in use: {self.breakdown()}"
            )
        charge.nbytes = int(nbytes)
        self._used += delta

    def release(self, handle: ChargeHandle) -> int:
        """Give a charge's bytes back to the pool; returns how many."""
        charge = self._get(handle)
        del self._charges[handle.charge_id]
        self._used -= charge.nbytes
        return charge.nbytes

    def nbytes(self, handle: ChargeHandle) -> int:
        return self._get(handle).nbytes

    def _get(self, handle: ChargeHandle) -> _Charge:
        charge = self._charges.get(handle.charge_id)
        if charge is None:
            raise KeyError(f"charge {handle.charge_id} ({handle.kind.value}/{handle.owner}) is not held by this pool")
        return charge

    # --- reporting -----------------------------------------------------------------
    def breakdown(self) -> dict[str, int]:
        """Bytes per kind (every kind listed, zeros included) plus 'free'."""
        out = {kind.value: 0 for kind in MemoryKind}
        for charge in self._charges.values():
            out[charge.kind.value] += charge.nbytes
        out["free"] = self.free_bytes
        return out

    def by_owner(self, kind: MemoryKind | None = None) -> dict[str, dict[str, int]]:
        """kind -> owner -> bytes, for the planner's memory economy."""
        out: dict[str, dict[str, int]] = {}
        for charge in self._charges.values():
            if kind is not None and charge.kind is not MemoryKind(kind):
                continue
            owners = out.setdefault(charge.kind.value, {})
            owners[charge.owner] = owners.get(charge.owner, 0) + charge.nbytes
        return out

    def bytes_of(self, kind: MemoryKind, owner: str | None = None) -> int:
        kind = MemoryKind(kind)
        return sum(
            c.nbytes for c in self._charges.values() if c.kind is kind and (owner is None or c.owner == owner)
        )
