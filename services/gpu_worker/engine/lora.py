"""LoRA adapters in PEFT format: host store + device LRU cache charged to the memory pool.

Reading one adapter is `lora_adapter` (re-exported here).

Adapters are read once into host memory (`register`) and copied to the device on demand
(`ensure_resident`) into an LRU cache; each resident adapter is charged to the pool as
kind "lora" and its charge released on eviction. A pinned adapter (`pin`) stays on the
device: LRU never evicts it. `offload` drops one device copy on demand (the planner's memory
economy): the adapter stays registered, its host copy stays, and its next use loads it again.
The host repository may be bounded (`host_limit_bytes`, the worker's `lora_host_memory`):
beyond it the least recently used adapters that have a directory to re-read are spilled
(registered still; read again on next use).

With `share_host()` (a worker that runs CPU LoRA helpers) every host copy lives in a shared file
(`lora_shared`): the helpers map the same copy, and `on_host(name, layout | None)` tells them when
one appears or goes (registered, re-read after a spill / unregistered, spilled, replaced).
"""
from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import torch

from .adapter_lru import AdapterLRU
from .lora_adapter import TARGETS, LoRAAdapter, load_adapter, target_shape
from .lora_batch import LoRABatch, build_lora_batch
from .lora_page_lock import PageLocks
from .lora_shared import SharedLayout, release, share
from .model_config import ModelConfig

__all__ = ["TARGETS", "AdapterPinnedError", "LoRAAdapter", "LoRAManager", "load_adapter", "target_shape"]


class AdapterPinnedError(ValueError):
    """`offload` of a pinned adapter: it never leaves the device (unpin it, or unregister it)."""


class LoRAManager:
    """Host store of registered adapters and the device LRU cache (pool kind "lora")."""

    def __init__(
        self,
        cfg: ModelConfig,
        layers: Iterable[int],
        pool: Any,
        device: torch.device | str = "cpu",
        mode: str = "segmented",
        max_resident: int | None = None,
    ) -> None:
        self.cfg = cfg
        self.layers = sorted(layers)
        self.pool = pool
        self.device = torch.device(device)
        self.mode = mode
        self.max_resident = max_resident
        self.host: dict[str, LoRAAdapter] = {}
        self.resident: OrderedDict[str, tuple[LoRAAdapter, Any]] = OrderedDict()  # name -> (adapter, charge)
        self._stacks: dict[tuple[str, ...], dict] = {}  # padded path: stacked weights per adapter set
        self.pinned: set[str] = set()  # device level: never LRU-evicted
        self.host_lru = AdapterLRU()  # host copies held (spilled ones are not); bounded by host_limit_bytes
        self.paths: dict[str, Path] = {}  # where a spilled adapter is read again from
        self.spilled: dict[str, LoRAAdapter] = {}  # registered, weights dropped (name, rank kept)
        self.shared = False  # host copies in shared files (share_host): the CPU helpers map them
        self.layouts: dict[str, SharedLayout] = {}  # name -> its shared host copy
        self.on_host: Callable[[str, SharedLayout | None], None] | None = None
        self.page_locks = PageLocks()  # enabled by the engine on CUDA (lora_page_lock.py)
        # (names, layer) -> those of `names` made resident now: between layers of a CPU-assisted step,
        # loads that landed (cold_start.py; cpu_lora_batch.py's mid-step takeover). None: never
        self.landing: Callable[[set[str], int], set[str]] | None = None

    def share_host(self) -> None:
        """From now on every host copy is one shared file (those held now are moved there)."""
        if self.shared:
            return
        self.shared = True
        for name, adapter in list(self.host.items()):
            if name not in self.spilled:
                self.page_locks.unlock(name)
                self.host[name] = self._held(adapter)

    def _held(self, adapter: LoRAAdapter) -> LoRAAdapter:
        """The host copy kept for `adapter`: in a shared file when shared, page-locked when enabled."""
        return self.page_locks.lock(self._shared(adapter), self.shared)

    def _shared(self, adapter: LoRAAdapter) -> LoRAAdapter:
        if not self.shared:
            return adapter
        self._drop_shared(adapter.name)
        moved, layout = share(adapter)
        self.layouts[adapter.name] = layout
        if self.on_host is not None:
            self.on_host(adapter.name, layout)
        return moved

    def _drop_shared(self, name: str) -> None:
        layout = self.layouts.pop(name, None)
        if layout is not None:
            if self.on_host is not None:
                self.on_host(name, None)
            release(layout)

    def set_host_limit(self, limit_bytes: int | None) -> None:
        self.host_lru.limit_bytes = limit_bytes

    def register(self, name: str, path: str | Path) -> LoRAAdapter:
        adapter = load_adapter(path, name, self.cfg, self.layers)
        self.install(adapter, path)
        return adapter

    def install(self, adapter: LoRAAdapter, path: str | Path | None = None, *, pinned: bool = False) -> None:
        """Register an adapter already read (`path`: its directory, so it may be spilled and re-read);
        pinned: made resident now and never LRU-evicted (MemoryError, and not registered, if no room)."""
        name = adapter.name
        self.unregister(name)
        self._hold(adapter)
        self.host[name] = self._held(adapter)
        if path is not None:
            self.paths[name] = Path(path)
        else:
            self.host_lru.pin(name)  # nothing to read it back from: never spilled
        if pinned:
            try:
                self.pin(name)
            except MemoryError:
                self.unregister(name)
                raise

    def pin(self, name: str) -> None:
        self.ensure_resident([name])
        self.pinned.add(name)

    def unpin(self, name: str) -> None:
        self.pinned.discard(name)

    def unregister(self, name: str) -> None:
        self._evict(name)
        self.host.pop(name, None)
        self.page_locks.unlock(name)
        self._drop_shared(name)
        self.pinned.discard(name)
        self.host_lru.remove(name)
        self.paths.pop(name, None)
        self.spilled.pop(name, None)

    def rank(self, name: str) -> int:
        return self.host[name].rank if name in self.host else self._host(name).rank

    def residency(self) -> list[tuple[str, str, bool, int, int]]:
        """(adapter, level "device" | "host", pinned, rank, bytes) per level each adapter is held at."""
        rows = [(n, "device", n in self.pinned, a.rank, a.nbytes) for n, (a, _) in self.resident.items()]
        rows += [(n, "host", n in self.pinned, self.host[n].rank, self.host_lru.size(n)) for n in self.host_lru]
        return rows

    def offload(self, name: str) -> int:
        """Drop `name`'s device copy, releasing its pool charge; it stays registered and its host copy
        stays (the next `ensure_resident` loads it again). Returns the device bytes freed (0: it had
        no device copy). KeyError if `name` is not registered, AdapterPinnedError if it is pinned."""
        if name not in self.host:
            raise KeyError(f"unknown LoRA adapter {name!r} (registered: {sorted(self.host)})")
        if name in self.pinned:
            raise AdapterPinnedError(f"LoRA adapter {name!r} is pinned: it is never taken off the device")
        entry = self.resident.get(name)
        if entry is None:
            return 0
        freed = int(entry[0].nbytes)
        self._evict(name)
        return freed

    def room_bytes(self) -> int:
        """Device bytes a newly loaded adapter could get: the pool's free bytes and unpinned adapters."""
        return self.pool.free_bytes + sum(a.nbytes for n, (a, _) in self.resident.items() if n not in self.pinned)

    def ensure_resident(self, names: Iterable[str]) -> None:
        """Load `names` to the device (LRU), evicting others not in `names` when short."""
        wanted = list(dict.fromkeys(names))
        for name in wanted:
            if name in self.resident:
                self.resident.move_to_end(name)
                continue
            adapter = self._host(name)
            if self.max_resident is not None:
                while len(self.resident) >= self.max_resident and self._evict_one(wanted):
                    pass
            while True:
                try:  # the pool first reclaims free KV blocks; then we evict cold adapters
                    charge = self.pool.charge("lora", f"lora:{name}", adapter.nbytes)
                    break
                except MemoryError as exc:
                    if not self._evict_one(wanted):
                        raise MemoryError(f"no room for LoRA adapter {name!r} ({adapter.nbytes} B): {exc}") from exc
            self.resident[name] = (adapter.to(self.device), charge)

    def reserve(self, name: str, keep: Iterable[str] = ()) -> tuple[LoRAAdapter, Any]:
        """Charge the pool for `name`'s device copy (evicting cold adapters not in `keep`, as
        `ensure_resident` does) without copying: the copy runs elsewhere (`lora_loads`) and
        `admit` makes it resident. Returns (host copy, charge); MemoryError if there is no room."""
        wanted = [name, *keep]
        adapter = self._host(name)
        if self.max_resident is not None:
            while len(self.resident) >= self.max_resident and self._evict_one(wanted):
                pass
        while True:
            try:
                return adapter, self.pool.charge("lora", f"lora:{name}", adapter.nbytes)
            except MemoryError as exc:
                if not self._evict_one(wanted):
                    raise MemoryError(f"no room for LoRA adapter {name!r} ({adapter.nbytes} B): {exc}") from exc

    def admit(self, name: str, source: LoRAAdapter, moved: LoRAAdapter, charge: Any) -> bool:
        """A reserved copy landed: resident from now on. False (charge released) if the adapter was
        unregistered or replaced while it was on its way."""
        current = self.host.get(name)
        if current is None or (current is not source and name not in self.spilled and current.weights):
            self.pool.release(charge)
            return False
        self.resident[name] = (moved, charge)
        return True

    def prepare_batch(self, adapters: list[str | None], q_lens: list[int]) -> LoRABatch | None:
        """Per-chunk adapter names → the step's LoRA hook (None when no chunk has one)."""
        names = sorted({a for a in adapters if a is not None})
        if not names:
            return None
        self.ensure_resident(names)
        resident = {n: self.resident[n][0] for n in names}
        stacks = None
        if self.mode == "padded":
            stacks = self._stacks.setdefault(tuple(names), {})
            while len(self._stacks) > 8:  # bounded: drop the oldest adapter sets
                self._stacks.pop(next(iter(self._stacks)))
        return build_lora_batch(self.mode, names, resident, adapters, q_lens, self.device, stacks)

    def clear(self) -> None:
        """Evict every resident adapter (their pool charges are released)."""
        for name in list(self.resident):
            self._evict(name)

    def _host(self, name: str) -> LoRAAdapter:
        adapter = self.host.get(name)
        if adapter is None:
            raise KeyError(f"unknown LoRA adapter {name!r} (registered: {sorted(self.host)})")
        if name in self.spilled:  # cold: read the directory again (it was checked when registered)
            adapter = load_adapter(self.paths[name], name, self.cfg, self.layers)
            self._hold(adapter)
            adapter = self.host[name] = self._held(adapter)
            del self.spilled[name]
        else:
            self.host_lru.touch(name)
        return adapter

    def _hold(self, adapter: LoRAAdapter) -> None:
        """Count a host copy in the repository, spilling least recently used ones beyond its limit."""
        victims = self.host_lru.victims_for(adapter.nbytes, keep={adapter.name})
        if victims is None:
            raise MemoryError(f"LoRA adapter {adapter.name!r} ({adapter.nbytes} B) does not fit the host repository "
                              f"({self.host_lru.limit_bytes} B, {self.host_lru.bytes} B held by adapters it cannot spill)")
        for victim in victims:
            held = self.host[victim]
            self.page_locks.unlock(victim)
            self._drop_shared(victim)
            self.spilled[victim] = LoRAAdapter(victim, held.rank, {})
            self.host[victim] = self.spilled[victim]
            self.host_lru.remove(victim)
        self.host_lru.add(adapter.name, adapter.nbytes)

    def _evict_one(self, keep: list[str]) -> bool:
        """Evict the least recently used adapter neither pinned nor in `keep`; False if there is none."""
        victim = next((n for n in self.resident if n not in keep and n not in self.pinned), None)
        if victim is not None:
            self._evict(victim)
        return victim is not None

    def _evict(self, name: str) -> None:
        entry = self.resident.pop(name, None)
        if entry is not None:
            self.pool.release(entry[1])
            self._stacks = {k: v for k, v in self._stacks.items() if name not in k}
