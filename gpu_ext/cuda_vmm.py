"""The KV region on CUDA: reserve the address range once, map physical memory per chunk.

The driver's virtual memory management (CUDA ≥ 10.2) separates an address range from the
memory behind it: `cuMemAddressReserve` takes a range as large as the pool could ever give
this instance's KV, and each chunk of the allocation granularity (2 MiB on Hopper) gets a
physical allocation (`cuMemCreate`) mapped into its place (`cuMemMap` + `cuMemSetAccess`) only
when a block inside it is first handed out. So the KV tensor's base address never changes:
when weights are dropped (KunServe) or a prewarmed model's bytes are released (WarmServe),
new block ids map fresh chunks in place — no live KV is copied and no tensor is rebuilt —
and retiring blocks unmaps whole chunks, returning their memory to the driver for the other
instances and kinds on the device. Touching an unmapped address is a fatal device fault, so
the block manager backs blocks before handing them out (`ensure_backed`).

Memory freed by torch (dropped layers, evicted weights) sits in torch's caching allocator,
not the driver's: a chunk that does not fit asks torch to empty its cache once, then fails
with `MemoryError` (the pool's accounting should never let that happen).
"""
from __future__ import annotations

import torch
from cuda.bindings import driver as cu

from .typed_view import typed_view


class CudaVmmError(RuntimeError):
    pass


def _check(result: tuple) -> object:
    err, *rest = result
    if err != cu.CUresult.CUDA_SUCCESS:
        raise CudaVmmError(f"CUDA driver call failed: {err!r}")
    return rest[0] if len(rest) == 1 else tuple(rest)


class _Mapping:
    """The reserved range and its chunks. torch holds it (through `__cuda_array_interface__`)
    as long as any view of the region lives, so the range is unmapped and given back only
    after the last tensor over it is gone."""

    def __init__(self, address: int, nbytes: int, granularity: int) -> None:
        self.address, self.nbytes, self.granularity = address, nbytes, granularity
        self.handles: dict[int, object] = {}  # chunk index -> its physical allocation
        self.__cuda_array_interface__ = {"shape": (nbytes,), "typestr": "|u1", "data": (address, False),
                                         "version": 3, "strides": None, "stream": None}

    def unmap(self, chunk: int) -> None:
        g = self.granularity
        _check(cu.cuMemUnmap(self.address + chunk * g, g))
        _check(cu.cuMemRelease(self.handles.pop(chunk)))

    def __del__(self) -> None:
        try:
            for chunk in list(self.handles):
                self.unmap(chunk)
            cu.cuMemAddressFree(self.address, self.nbytes)
        except Exception:  # noqa: BLE001 - interpreter shutdown: the driver may be gone already
            pass


class CudaVmmRegion:
    needs_backing = True

    def __init__(self, nbytes: int, device: torch.device) -> None:
        index = device.index if device.index is not None else torch.cuda.current_device()
        self.device = torch.device("cuda", index)
        torch.cuda.init()
        with torch.cuda.device(self.device):
            torch.empty(1, device=self.device)  # the primary context exists and is current
        self._prop = cu.CUmemAllocationProp()
        self._prop.type = cu.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
        self._prop.location.type = cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        self._prop.location.id = index
        # exportable as a file descriptor, so UCX's cuda_ipc can map KV blocks into a peer process
        # (KV migration on one node); dropped again if the driver refuses it
        self._prop.requestedHandleTypes = cu.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
        self.granularity = int(_check(cu.cuMemGetAllocationGranularity(
            self._prop, cu.CUmemAllocationGranularity_flags.CU_MEM_ALLOC_GRANULARITY_MINIMUM)))
        g = self.granularity
        self.nbytes = max(g, -(-nbytes // g) * g)
        self._access = cu.CUmemAccessDesc()
        self._access.location.type = cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        self._access.location.id = index
        self._access.flags = cu.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE
        with torch.cuda.device(self.device):
            self.address = int(_check(cu.cuMemAddressReserve(self.nbytes, g, 0, 0)))
        self._mapping = _Mapping(self.address, self.nbytes, g)
        self._handles = self._mapping.handles
        self._bytes = torch.as_tensor(self._mapping, device=self.device)

    def as_tensor(self, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
        return typed_view(self._bytes, dtype, shape)

    def _chunks(self, offset: int, nbytes: int, whole: bool) -> range:
        g = self.granularity
        if offset < 0 or nbytes < 0 or offset + nbytes > self.nbytes:
            raise ValueError(f"range [{offset}, {offset + nbytes}) outside the region (0..{self.nbytes})")
        if whole:  # only chunks entirely inside the range
            return range(-(-offset // g), (offset + nbytes) // g)
        return range(offset // g, -(-(offset + nbytes) // g))

    def ensure_backed(self, offset: int, nbytes: int) -> None:
        if nbytes <= 0:
            return
        with torch.cuda.device(self.device):
            for chunk in self._chunks(offset, nbytes, whole=False):
                if chunk not in self._handles:
                    self._map(chunk)

    def _map(self, chunk: int) -> None:
        g = self.granularity
        try:
            handle = self._create(g)
        except CudaVmmError:
            torch.cuda.empty_cache()  # freed weights may still sit in torch's cache
            try:
                handle = self._create(g)
            except CudaVmmError as exc:
                raise MemoryError(f"no device memory for a KV chunk of {g} bytes: {exc}") from exc
        at = self.address + chunk * g
        try:
            _check(cu.cuMemMap(at, g, 0, handle, 0))
            _check(cu.cuMemSetAccess(at, g, [self._access], 1))
        except CudaVmmError:
            cu.cuMemUnmap(at, g)
            cu.cuMemRelease(handle)
            raise
        self._handles[chunk] = handle

    def _create(self, nbytes: int) -> object:
        err, handle = cu.cuMemCreate(nbytes, self._prop, 0)
        if err == cu.CUresult.CUDA_ERROR_NOT_SUPPORTED and self._prop.requestedHandleTypes:
            self._prop.requestedHandleTypes = cu.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_NONE
            err, handle = cu.cuMemCreate(nbytes, self._prop, 0)
        if err != cu.CUresult.CUDA_SUCCESS:
            raise CudaVmmError(f"cuMemCreate of {nbytes} bytes failed: {err!r}")
        return handle

    def release(self, offset: int, nbytes: int) -> None:
        if nbytes <= 0:
            return
        g = self.granularity
        chunks = [c for c in self._chunks(offset, nbytes, whole=True) if c in self._handles]
        if not chunks:
            return
        torch.cuda.synchronize(self.device)  # no kernel in flight may still touch them
        with torch.cuda.device(self.device):
            for chunk in chunks:
                self._mapping.unmap(chunk)

    def resident_bytes(self) -> int:
        return len(self._handles) * self.granularity


__all__ = ["CudaVmmError", "CudaVmmRegion"]
