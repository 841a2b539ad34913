"""Payload memory: byte views of tensors, a transfer's segments, chunk pieces, checksums.

The device path lives here and only here. A CPU tensor or array becomes a flat uint8 numpy
view of the same memory (no copy); UCX sends from it and receives into it. A CUDA tensor is
kept as a flat uint8 *torch* view: ucxx takes it through `__cuda_array_interface__` and UCX
moves device memory directly (CUDA IPC / GPUDirect) — the same code path above this module.
Checksums of device memory are not computed on the host (that would be a device->host copy
per chunk); `checksum_of` returns 0 for them and the sender announces `checksum="none"`.
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
    """Checksum of one contiguous view (0 for device memory or `none`)."""
    if algorithm == "none" or not is_host(view):
        return 0
    if algorithm == "xxh3_64":
        return _xxh3(view)
    if algorithm == "crc32":
        return zlib.crc32(view)
    raise ValueError(f"unknown checksum algorithm {algorithm!r}")


def checksum_algorithm(views: Sequence[ByteView]) -> str:
    return DEFAULT_CHECKSUM if all(is_host(v) for v in views) else "none"


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
        return _concat(parts)

    def scatter(self, offset: int, staged: ByteView) -> None:
        """Copy a staged chunk back into the segments it covers."""
        pos = 0
        for part in self.pieces(offset, int(staged.shape[0])):
            n = int(part.shape[0])
            part[:] = staged[pos:pos + n]
            pos += n


def _concat(parts: list[ByteView]) -> ByteView:
    if all(is_host(p) for p in parts):
        return np.concatenate(parts)
    torch = _torch()
    assert torch is not None
    return torch.cat([p if not is_host(p) else torch.from_numpy(p).to(parts[0].device) for p in parts])


def empty_like_device(template: ByteView, nbytes: int) -> ByteView:
    """A staging buffer on the same device as `template`."""
    if is_host(template):
        return np.empty(nbytes, dtype=np.uint8)
    torch = _torch()
    assert torch is not None
    return torch.empty(nbytes, dtype=torch.uint8, device=template.device)


def _torch() -> Any:
    import sys

    return sys.modules.get("torch")  # only tensors of an already-imported torch can be passed in
