"""One memory pool per device: every byte charged to one kind, one owner and one tenant.

The pool is pure accounting (no torch): it decides whether bytes may be used and by
whom; the runner and gpu_ext own the actual storage. A worker's model instances share
one pool, each through its own `PoolView` (tenant = the instance id, below), so weights,
adapters, workspace and KV of every instance draw on the same bytes.

KV takes what is left, on demand: each instance's block manager claims free pool bytes
as blocks and registers a reclaimer, so a charge that finds the pool short asks the KV
of every tenant to give back FREE blocks (never live ones) before refusing. Between
tenants, a block manager that cannot get the blocks it needs files a *want*: wanted
bytes are earmarked, oldest want first, so that blocks another instance frees (and gives
back at its next step) go to the instance that waits, not back to the busy one.

Thread-safe: instances step on their own threads, so every method takes `lock` (one
re-entrant lock: a charge calls reclaimers, which resize their own KV charge). Block
managers hold the same lock while they touch their free blocks. See DESIGN "the memory
economy".
"""
from __future__ import annotations

import enum
import itertools
import threading
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
    tenant: str


# `reclaim(missing_bytes, keep_floor)` gives back what it can of its unused bytes (bytes
# given); with keep_floor, a tenant that is busy keeps its small floor of free KV blocks.
Reclaimer = Callable[[int, bool], int]


class MemoryPool:
    tenant = ""  # charges made on the pool itself (a private pool) belong to tenant ""

    def __init__(self, capacity_bytes: int, device: str = "cpu") -> None:
        if capacity_bytes < 0:
            raise ValueError(f"pool capacity must be >= 0 bytes, got {capacity_bytes}")
        self.device = device
        self.lock = threading.RLock()
        self._capacity = int(capacity_bytes)
        self._charges: dict[int, _Charge] = {}
        self._ids = itertools.count(1)
        self._used = 0
        self._reclaimers: dict[tuple[MemoryKind, str], Reclaimer] = {}
        self._wants: dict[str, int] = {}  # tenant -> KV bytes it waits for; insertion order = oldest first

    @property
    def root(self) -> MemoryPool:
        return self

    def view(self, tenant: str) -> PoolView:
        """This pool as one tenant (model instance) sees it: its charges, the shared free bytes."""
        return PoolView(self, tenant)

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
        with self.lock:
            if capacity_bytes < self._used:
                raise PoolExhausted(
                    f"cannot set pool capacity to {capacity_bytes} B: {self._used} B are charged ({self.breakdown()})"
                )
            self._capacity = int(capacity_bytes)

    # --- charging ------------------------------------------------------------------
    def register_reclaimer(self, kind: MemoryKind, reclaimer: Reclaimer, tenant: str = "") -> None:
        """`reclaimer(missing_bytes, keep_floor)` releases some of (kind, tenant)'s unused bytes on demand."""
        with self.lock:
            self._reclaimers[(MemoryKind(kind), tenant)] = reclaimer

    def unregister_reclaimers(self, tenant: str) -> None:
        with self.lock:
            for key in [k for k in self._reclaimers if k[1] == tenant]:
                del self._reclaimers[key]
            self._wants.pop(tenant, None)

    def _make_room(self, nbytes: int, exclude: MemoryKind, tenant: str) -> None:
        # The asking tenant's own unused bytes first, then the others'; busy tenants keep
        # their floor unless nothing else makes the charge fit.
        order = sorted(
            ((k, t, r) for (k, t), r in self._reclaimers.items() if k is not exclude), key=lambda e: e[1] != tenant
        )
        for keep_floor in (True, False):
            for _kind, _tenant, reclaim in order:
                if self.free_bytes >= nbytes:
                    return
                reclaim(nbytes - self.free_bytes, keep_floor)

    def charge(
        self, kind: MemoryKind, owner: str, nbytes: int, *, reclaim: bool = True, tenant: str = ""
    ) -> ChargeHandle:
        """Charge `nbytes` to (kind, owner) of `tenant`; refuse with PoolExhausted if they cannot fit."""
        kind = MemoryKind(kind)
        if nbytes < 0:
            raise ValueError(f"charge for {kind.value}/{owner}: nbytes must be >= 0, got {nbytes}")
        with self.lock:
            if nbytes > self.free_bytes and reclaim:
                self._make_room(nbytes, kind, tenant)
            if nbytes > self.free_bytes:
                raise PoolExhausted(
                    f"{self.device} pool: cannot charge {nbytes} B to {kind.value}/{owner}: "
                    f"{self.free_bytes} B free of {self._capacity} B; in use: {self.breakdown()}"
                )
            charge_id = next(self._ids)
            self._charges[charge_id] = _Charge(kind, owner, int(nbytes), tenant)
            self._used += int(nbytes)
            return ChargeHandle(charge_id, kind, owner)

    def resize(self, handle: ChargeHandle, nbytes: int, *, reclaim: bool = True) -> None:
        """Grow or shrink an existing charge in place (KV uses this as blocks come and go)."""
        with self.lock:
            charge = self._get(handle)
            delta = int(nbytes) - charge.nbytes
            if delta > self.free_bytes and reclaim:
                self._make_room(delta, charge.kind, charge.tenant)
            if delta > self.free_bytes:
                raise PoolExhausted(
                    f"{self.device} pool: cannot grow {charge.kind.value}/{charge.owner} by {delta} B: "
                    f"{self.free_bytes} B free; in use: {self.breakdown()}"
                )
            charge.nbytes = int(nbytes)
            self._used += delta

    def release(self, handle: ChargeHandle) -> int:
        """Give a charge's bytes back to the pool; returns how many."""
        with self.lock:
            charge = self._get(handle)
            del self._charges[handle.charge_id]
            self._used -= charge.nbytes
            return charge.nbytes

    def nbytes(self, handle: ChargeHandle) -> int:
        with self.lock:
            return self._get(handle).nbytes

    def _get(self, handle: ChargeHandle) -> _Charge:
        charge = self._charges.get(handle.charge_id)
        if charge is None:
            raise KeyError(f"charge {handle.charge_id} ({handle.kind.value}/{handle.owner}) is not held by this pool")
        return charge

    # --- KV between tenants ----------------------------------------------------------
    @property
    def has_wants(self) -> bool:
        """Whether any tenant waits for KV (a hint: read without the lock)."""
        return bool(self._wants)

    def available_to(self, tenant: str) -> int:
        """Free bytes `tenant` may claim for KV: what older wants of other tenants leave."""
        with self.lock:
            ahead = 0
            for t, nbytes in self._wants.items():
                if t == tenant:
                    break
                ahead += nbytes
            return max(0, self.free_bytes - ahead)

    def wanted_by_others(self, tenant: str) -> int:
        """KV bytes other tenants wait for beyond what is free (what `tenant` should give back)."""
        with self.lock:
            wanted = sum(nbytes for t, nbytes in self._wants.items() if t != tenant)
            return max(0, wanted - self.free_bytes)

    def set_want(self, tenant: str, nbytes: int) -> None:
        """`tenant` waits for `nbytes` more KV bytes (0: for none); a renewed want keeps its place."""
        with self.lock:
            if nbytes > 0:
                self._wants[tenant] = int(nbytes)
            else:
                self._wants.pop(tenant, None)

    def reclaim_kv(self, tenant: str, nbytes: int) -> None:
        """Ask the other tenants' KV for free blocks until `tenant` may claim `nbytes` (each
        keeps its floor); the tenant holding the most KV is asked first."""
        with self.lock:
            others = [(t, r) for (k, t), r in self._reclaimers.items() if k is MemoryKind.KV and t != tenant]
            others.sort(key=lambda e: -self.bytes_of(MemoryKind.KV, tenant=e[0]))
            for _other, reclaim in others:
                missing = nbytes - self.available_to(tenant)
                if missing <= 0:
                    return
                reclaim(missing, True)
            # then prewarmed weights (WarmServe): a serving instance's KV outranks a model kept warm
            for (k, _t), reclaim in list(self._reclaimers.items()):
                missing = nbytes - self.available_to(tenant)
                if missing <= 0:
                    return
                if k is MemoryKind.PREWARM:
                    reclaim(missing, False)

    def release_tenant(self, tenant: str) -> dict[str, int]:
        """Release every charge of `tenant` (an instance stopped) and forget its reclaimers and want;
        returns the bytes released by `kind:owner`."""
        with self.lock:
            released: dict[str, int] = {}
            for charge_id, charge in list(self._charges.items()):
                if charge.tenant == tenant:
                    del self._charges[charge_id]
                    self._used -= charge.nbytes
                    name = f"{charge.kind.value}:{charge.owner}"
                    released[name] = released.get(name, 0) + charge.nbytes
            self.unregister_reclaimers(tenant)
            return released

    # --- reporting -----------------------------------------------------------------
    def breakdown(self, tenant: str | None = None) -> dict[str, int]:
        """Bytes per kind (every kind listed, zeros included; of one tenant if given) plus the pool's 'free'."""
        out = {kind.value: 0 for kind in MemoryKind}
        with self.lock:
            for charge in self._charges.values():
                if tenant is None or charge.tenant == tenant:
                    out[charge.kind.value] += charge.nbytes
            out["free"] = self.free_bytes
        return out

    def by_owner(self, kind: MemoryKind | None = None, tenant: str | None = None) -> dict[str, dict[str, int]]:
        """kind -> owner -> bytes (of one tenant if given), for the planner's memory economy."""
        out: dict[str, dict[str, int]] = {}
        want = None if kind is None else MemoryKind(kind)
        with self.lock:
            for charge in self._charges.values():
                if (want is not None and charge.kind is not want) or (tenant is not None and charge.tenant != tenant):
                    continue
                owners = out.setdefault(charge.kind.value, {})
                owners[charge.owner] = owners.get(charge.owner, 0) + charge.nbytes
        return out

    def bytes_of(self, kind: MemoryKind, owner: str | None = None, tenant: str | None = None) -> int:
        kind = MemoryKind(kind)
        with self.lock:
            return sum(
                c.nbytes for c in self._charges.values()
                if c.kind is kind and (owner is None or c.owner == owner) and (tenant is None or c.tenant == tenant)
            )


# One tenant's view of the shared pool (a model instance on a worker). The runner, the LoRA
# cache and the block manager take a pool and charge it without knowing it is shared: through
# a view their charges carry the tenant, and the reports (`breakdown`, `by_owner`, `bytes_of`)
# are the tenant's own; the totals (`capacity_bytes`, `free_bytes`) are the whole pool's,
# since every tenant draws on the same free bytes.
class PoolView:
    def __init__(self, pool: MemoryPool, tenant: str) -> None:
        if not tenant:
            raise ValueError("a pool view needs a non-empty tenant name")
        self.root = pool
        self.tenant = tenant

    @property
    def device(self) -> str:
        return self.root.device

    @property
    def lock(self) -> threading.RLock:
        return self.root.lock

    @property
    def capacity_bytes(self) -> int:
        return self.root.capacity_bytes

    @property
    def used_bytes(self) -> int:
        return self.root.used_bytes

    @property
    def free_bytes(self) -> int:
        return self.root.free_bytes

    def charge(self, kind: MemoryKind | str, owner: str, nbytes: int, *, reclaim: bool = True) -> ChargeHandle:
        return self.root.charge(kind, owner, nbytes, reclaim=reclaim, tenant=self.tenant)  # type: ignore[arg-type]

    def resize(self, handle: ChargeHandle, nbytes: int, *, reclaim: bool = True) -> None:
        self.root.resize(handle, nbytes, reclaim=reclaim)

    def release(self, handle: ChargeHandle) -> int:
        return self.root.release(handle)

    def nbytes(self, handle: ChargeHandle) -> int:
        return self.root.nbytes(handle)

    def register_reclaimer(self, kind: MemoryKind, reclaimer: Reclaimer) -> None:
        self.root.register_reclaimer(kind, reclaimer, self.tenant)

    def breakdown(self) -> dict[str, int]:
        return self.root.breakdown(self.tenant)

    def by_owner(self, kind: MemoryKind | None = None) -> dict[str, dict[str, int]]:
        return self.root.by_owner(kind, self.tenant)

    def bytes_of(self, kind: MemoryKind | str, owner: str | None = None) -> int:
        return self.root.bytes_of(kind, owner, self.tenant)  # type: ignore[arg-type]
