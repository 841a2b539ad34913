"""Payload memory: byte views of tensors, a transfer's segments, chunk pieces, checksums.

The device path lives here and only here. A CPU tensor or array becomes a flat uint8 numpy
view of the same memory (no copy); UCX sends from it and receives into it. A CUDA tensor is
kept as a flat uint8 *torch* view: ucxx takes it through `__cuda_array_interface__` and UCX
moves device memory directly (CUDA IPC / GPUDirect) — the same code path above this module.
Checksums of device memory are not computed on the host (that would be a device->host copy
per chunk): a sender with device memory announces `checksum="none"`. Only a host sender's
checksum over a chunk that landed in device memory is checked on a host copy of it.

UCX reads and writes device memory on CUDA streams of its own, outside torch's stream order,
so device memory is handed to UCX only once the kernels queued before are done
(`synchronize`): the sender's data written (`Link.submit`), a staging copy made (`gather`) or
scattered (`scatter`), a destination or staging buffer no longer in use by a kernel (`Sink`,
`empty_like_device`: the caching allocator may hand out memory a queued kernel still uses).
"""
from __future__ import annotations

import zlib
from typing import Any, Sequence

import numpy as np

try:  # ~5x faster than zlib.crc32 (26 vs 5 GiB/s on this machine): see docs/dataplane.md
    import xxhash

    def _xxh3(view: Any) -> int:
        return xxhash.xxh3_64_intdigest(view)

    DEFAULT_CHECKSUM = "xxh3_64"
except ImportError:  # pragma: no cover - xxhash is a dependency of the dataplane extra
    DEFAULT_CHECKSUM = "crc32"

ByteView = Any  # np.ndarray[uint8] (host) or a flat uint8 torch tensor (device)


def byte_view(obj: Any) -> ByteView:
    """A flat uint8 view of `obj`'s memory (torch tensor, numpy array, bytes-like); never a copy.

    Raises ValueError for non-contiguous tensors/arrays (copy them first: a silent copy here
    would make the receiver write into a temporary)."""
    torch = _torch()
    if torch is not None and isinstance(obj, torch.Tensor):
        if not obj.is_contiguous():
            raise ValueError("tensor is not contiguous; call .contiguous() before sending it")
        flat = obj.reshape(-1).view(torch.uint8) if obj.numel() else obj.new_empty(0, dtype=torch.uint8)
        if flat.device.type == "cpu":
            return flat.numpy()
        return flat  # CUDA: UCX reads/writes device memory itself
    if isinstance(obj, np.ndarray):
        if not obj.flags.c_contiguous:
            raise ValueError("array is not C-contiguous; copy it before sending it")
        return obj.reshape(-1).view(np.uint8)
    return np.frombuffer(memoryview(obj).cast("B"), dtype=np.uint8)  # bytes: read-only, fine to send


def is_host(view: ByteView) -> bool:
    return isinstance(view, np.ndarray)


def checksum_of(view: ByteView, algorithm: str) -> int:
    """Checksum of one contiguous view (0 for `none`, which a sender of device memory announces).
    A host sender's chunk that landed in device memory is checked on a host copy."""
    if algorithm == "none":
        return 0
    if not is_host(view):
        view = view.cpu().numpy()
    if algorithm == "xxh3_64":
        return _xxh3(view)
    if algorithm == "crc32":
        return zlib.crc32(view)
    raise ValueError(f"unknown checksum algorithm {algorithm!r}")


def checksum_algorithm(views: Sequence[ByteView]) -> str:
    return DEFAULT_CHECKSUM if all(is_host(v) for v in views) else "none"


def synchronize(views: Sequence[ByteView]) -> None:
    """Wait until the kernels queued on the devices of `views` are done (nothing for host memory):
    UCX moves device memory on its own streams, which torch's stream order does not cover."""
    devices = {v.device for v in views if not is_host(v) and v.device.type == "cuda"}
    if devices:
        torch = _torch()
        assert torch is not None
        for device in devices:
            torch.cuda.synchronize(device)


class Segments:
    """An ordered list of byte views forming one logical byte stream (a transfer's payload)."""

    def __init__(self, views: Sequence[ByteView]) -> None:
        self.views = list(views)
        self.sizes = [int(v.shape[0]) for v in self.views]
        self.starts: list[int] = []
        total = 0
        for n in self.sizes:
            self.starts.append(total)
            total += n
        self.total = total

    @classmethod
    def of(cls, buffers: Any) -> "Segments":
        if isinstance(buffers, (list, tuple)):
            return cls([byte_view(b) for b in buffers])
        return cls([byte_view(buffers)])

    def pieces(self, offset: int, length: int) -> list[ByteView]:
        """Views covering [offset, offset + length), one per segment touched."""
        if offset < 0 or length < 0 or offset + length > self.total:
            raise ValueError(f"range [{offset}, {offset + length}) is outside 0..{self.total}")
        out: list[ByteView] = []
        end = offset + length
        for start, size, view in zip(self.starts, self.sizes, self.views):
            lo, hi = max(offset, start), min(end, start + size)
            if lo < hi:
                out.append(view[lo - start:hi - start])
            if start >= end:
                break
        return out

    def gather(self, offset: int, length: int) -> ByteView:
        """[offset, offset + length) as ONE contiguous view: itself when it lies in one segment,
        else a staging copy (small segments such as KV blocks are coalesced into one message)."""
        parts = self.pieces(offset, length)
        if len(parts) == 1:
            return parts[0]
        if not parts:
            return np.empty(0, dtype=np.uint8)
        staged = _concat(parts)
        synchronize([staged])  # the copy is made before UCX reads it
        return staged

    def scatter(self, offset: int, staged: ByteView) -> None:
        """Copy a staged chunk back into the segments it covers."""
        pos = 0
        parts = self.pieces(offset, int(staged.shape[0]))
        for part in parts:
            n = int(part.shape[0])
            _copy(part, staged[pos:pos + n])
            pos += n
        synchronize([*parts, staged])  # the staging buffer is free for UCX's next write once this returns


def _copy(dest: ByteView, src: ByteView) -> None:
    """dest[:] = src, host or device on either side."""
    if is_host(dest) and is_host(src):
        dest[:] = src
    elif is_host(dest):
        dest[:] = src.cpu().numpy()
    else:
        torch = _torch()
        assert torch is not None
        dest.copy_(torch.from_numpy(src) if is_host(src) else src)


def _concat(parts: list[ByteView]) -> ByteView:
    if all(is_host(p) for p in parts):
        return np.concatenate(parts)
    torch = _torch()
    assert torch is not None
    device = next(p.device for p in parts if not is_host(p))
    return torch.cat([p if not is_host(p) else torch.from_numpy(p).to(device) for p in parts])


def empty_like_device(template: ByteView, nbytes: int) -> ByteView:
    """A staging buffer on the same device as `template`."""
    if is_host(template):
        return np.empty(nbytes, dtype=np.uint8)
    torch = _torch()
    assert torch is not None
    staged = torch.empty(nbytes, dtype=torch.uint8, device=template.device)
    synchronize([staged])  # the allocator may reuse memory a queued kernel still reads: UCX writes it now
    return staged


def _torch() -> Any:
    import sys

    return sys.modules.get("torch")  # only tensors of an already-imported torch can be passed in
