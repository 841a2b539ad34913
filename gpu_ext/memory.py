"""Device memory backing for the KV region: reserve big, back only what is used.

The engine reserves the KV region for the pool's MAX possible number of blocks once, so
block ids and the region's base address never change; physical memory is attached only
to the blocks in use. When weights are dropped, the pool's freed bytes simply allow more
block ids to be handed out — no copy of live KV, no new tensor.

- CPU (`CpuReservedRegion`): a private anonymous `mmap` with MAP_NORESERVE. The kernel
  backs a page on first touch; `release()` gives pages back with MADV_DONTNEED.
- CUDA (`CudaVmmRegion`, in `gpu_ext.cuda_vmm`): a virtual range reserved with the driver's
  VMM API (cuMemAddressReserve); physical chunks of the allocation granularity (2 MiB) are
  created and mapped (cuMemCreate / cuMemMap / cuMemSetAccess) when blocks in them are first
  handed out, and unmapped and freed when every block in a chunk is retired. Without the
  `cuda-bindings` package (it comes with the dataplane extra) the region is allocated eagerly
  (`CudaEagerRegion`), with a warning: correct, but each instance then holds its maximum.
"""
from __future__ import annotations

import ctypes
import logging
import mmap
from typing import Protocol

import torch

from .typed_view import typed_view

PAGE = mmap.PAGESIZE


class ReservedRegion(Protocol):
    nbytes: int
    device: torch.device
    needs_backing: bool  # ensure_backed must run before a range is touched (else the OS does it)

    def as_tensor(self, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
        """A tensor view over the whole region (`prod(shape) * itemsize <= nbytes`)."""
        ...

    def ensure_backed(self, offset: int, nbytes: int) -> None:
        """Attach physical memory to [offset, offset+nbytes) before first use."""
        ...

    def release(self, offset: int, nbytes: int) -> None:
        """Return the physical memory of [offset, offset+nbytes); contents are lost."""
        ...

    def resident_bytes(self) -> int:
        """Physical bytes currently attached (best effort; for tests and stats)."""
        ...


class CpuReservedRegion:
    """Lazily backed host memory: reserving costs address space, not RAM."""

    needs_backing = False

    def __init__(self, nbytes: int) -> None:
        self.nbytes = max(PAGE, -(-nbytes // PAGE) * PAGE)
        self.device = torch.device("cpu")
        flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | getattr(mmap, "MAP_NORESERVE", 0)
        self._map = mmap.mmap(-1, self.nbytes, flags=flags, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        self._bytes = torch.frombuffer(self._map, dtype=torch.uint8)

    def as_tensor(self, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
        return typed_view(self._bytes, dtype, shape)

    def ensure_backed(self, offset: int, nbytes: int) -> None:
        return None  # the OS backs pages on first write

    def release(self, offset: int, nbytes: int) -> None:
        start = -(-offset // PAGE) * PAGE  # only whole pages inside the range
        end = (offset + nbytes) // PAGE * PAGE
        if end > start:
            self._map.madvise(mmap.MADV_DONTNEED, start, end - start)

    def resident_bytes(self) -> int:
        return _resident_bytes_of(self._bytes.data_ptr(), self.nbytes)


class CudaEagerRegion:
    """The fallback without `cuda-bindings`: the whole region allocated up front (see module doc)."""

    needs_backing = False

    def __init__(self, nbytes: int, device: torch.device) -> None:
        self.nbytes = nbytes
        self.device = device
        self._bytes = torch.empty(nbytes, dtype=torch.uint8, device=device)

    def as_tensor(self, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
        return typed_view(self._bytes, dtype, shape)

    def ensure_backed(self, offset: int, nbytes: int) -> None:
        return None

    def release(self, offset: int, nbytes: int) -> None:
        return None

    def resident_bytes(self) -> int:
        return self.nbytes


def reserve_region(nbytes: int, device: torch.device | str = "cpu") -> ReservedRegion:
    device = torch.device(device)
    if device.type == "cpu":
        return CpuReservedRegion(nbytes)
    if device.type == "cuda":
        try:
            from .cuda_vmm import CudaVmmRegion
        except ImportError as exc:  # cuda-bindings missing: correct, but not lazily backed
            logging.getLogger(__name__).warning("KV region allocated eagerly (no CUDA VMM: %s)", exc)
            return CudaEagerRegion(nbytes, device)
        return CudaVmmRegion(nbytes, device)
    raise ValueError(f"no memory backend for device {device}")


def _resident_bytes_of(address: int, nbytes: int) -> int:
    """Resident bytes of [address, address+nbytes), by mincore(2) (Linux; -1 if unavailable).
    Per-range, unlike /proc/self/smaps whose entries merge neighbouring mappings."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        pages = -(-nbytes // PAGE)
        vec = (ctypes.c_ubyte * pages)()
        if libc.mincore(ctypes.c_void_p(address), ctypes.c_size_t(nbytes), vec) != 0:
            return -1
    except (OSError, AttributeError):
        return -1
    return (pages - bytes(vec).count(0)) * PAGE
