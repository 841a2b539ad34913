"""Page-locked host copies of LoRA adapters, on a CUDA engine only (issue 31).

A copy to the device from pageable memory goes through a staging buffer (docs/gpu.md measured
3.4 GB/s for 12.6 MB adapters on the H200 machine); from page-locked memory it is one DMA at the
link's rate, asynchronous on the loader's stream. Whether to lock is `page_lock_host`
(shared/policy/lora_cold_choice.py: a CUDA engine where CUDA is there, and the setting allows).

* A plain host copy is replaced by a pinned one (`pin_memory`: freed with its tensors).
* A host copy in a shared file (CPU LoRA helpers on: `lora_shared`) is registered in place
  (`cudaHostRegister` of each distinct storage) so the helpers still map the same bytes; it is
  unregistered when the adapter is dropped — after any copy still reading it has landed (`busy`),
  so no DMA reads memory that was unregistered under it (`flush` retries the deferred ones).

Disabled (a CPU engine, or CUDA absent) every call returns its input and locks nothing.
"""
from __future__ import annotations

from collections.abc import Callable

from .lora_adapter import LoRAAdapter


class PageLocks:
    def __init__(self, enabled: bool = False, busy: Callable[[str], bool] = lambda _name: False) -> None:
        self.enabled = enabled
        self.busy = busy  # name -> a copy of it to the device is in flight
        # name -> (host pointers registered with CUDA, a tensor of each: their mapping outlives the registration)
        self._registered: dict[str, tuple[list[int], list[object]]] = {}
        self._pinned: set[str] = set()  # names whose host copy is a pinned copy
        self._deferred: list[tuple[str, tuple[list[int], list[object]]]] = []  # waiting for a copy in flight

    def locked(self, name: str) -> bool:
        return name in self._registered or name in self._pinned

    def kind(self, name: str) -> str:
        """The link kind a load of `name` runs over ("page-locked" | "pageable")."""
        return "page-locked" if self.locked(name) else "pageable"

    def lock(self, adapter: LoRAAdapter, shared: bool) -> LoRAAdapter:
        """The host copy to hold for `adapter`: pinned (plain) or registered in place (shared file)."""
        if not self.enabled or not adapter.weights:
            return adapter
        self.unlock(adapter.name)
        if not shared:
            pinned = LoRAAdapter(adapter.name, adapter.rank,
                                 {k: (a.pin_memory(), b.pin_memory()) for k, (a, b) in adapter.weights.items()})
            self._pinned.add(adapter.name)
            return pinned
        import torch

        cudart = torch.cuda.cudart()
        ptrs: list[int] = []
        storages = _storages(adapter)
        for ptr, size, _ in storages:
            err = cudart.cudaHostRegister(ptr, size, 0)
            if int(err) != 0:  # keep it pageable: loads still work, at the pageable rate
                for done in ptrs:
                    cudart.cudaHostUnregister(done)
                return adapter
            ptrs.append(ptr)
        self._registered[adapter.name] = (ptrs, [t for _, _, t in storages])
        return adapter

    def unlock(self, name: str) -> None:
        self._pinned.discard(name)
        entry = self._registered.pop(name, None)
        if entry:
            self._deferred.append((name, entry))
        self.flush()

    def flush(self) -> None:
        """Unregister the dropped copies no load reads any more."""
        if not self._deferred:
            return
        import torch

        keep = []
        for name, entry in self._deferred:
            if self.busy(name):
                keep.append((name, entry))
                continue
            for ptr in entry[0]:
                torch.cuda.cudart().cudaHostUnregister(ptr)
        self._deferred = keep


def _storages(adapter: LoRAAdapter) -> list[tuple[int, int, object]]:
    """(pointer, bytes, a tensor on it) of each distinct storage under the adapter's tensors."""
    seen: dict[int, tuple[int, int, object]] = {}
    for a, b in adapter.weights.values():
        for t in (a, b):
            s = t.untyped_storage()
            seen.setdefault(s.data_ptr(), (s.data_ptr(), s.nbytes(), t))
    return sorted(seen.values(), key=lambda e: e[0])


__all__ = ["PageLocks"]
