"""One tenant's view of a shared `MemoryPool` (a model instance on a worker).

The runner, the LoRA cache and the block manager take a pool and charge it without
knowing it is shared: through a view their charges carry the tenant, and the reports
(`breakdown`, `by_owner`, `bytes_of`) are the tenant's own; the totals (`capacity_bytes`,
`free_bytes`) are the whole pool's, since every tenant draws on the same free bytes.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import threading

    from services.gpu_worker.engine.memory_pool import ChargeHandle, MemoryKind, MemoryPool, Reclaimer


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
