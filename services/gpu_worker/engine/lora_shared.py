"""A worker's host copies of LoRA adapters in shared memory: one copy for the engine and all its helpers.

CaraServe §4.1: the CPU LoRA processes hold the adapters before any request needs them. Here the
engine's own host copy (`LoRAManager.host`, what loads copy to the device) lives in one shared
file per adapter (`/dev/shm`, else the temporary directory), mapped with `torch.from_file(shared=
True)`; the CPU helpers map the same file from its `SharedLayout` (name, dtype, offsets): one host
copy per worker, however many helpers, and no helper reads an adapter directory on the request
path (REGISTER goes out when the adapter is registered, or when the helpers start).

The file is unlinked when the adapter is dropped (unregistered, spilled, replaced); mappings still
open (a load in flight, a helper that has not yet seen UNREGISTER) stay valid until they close. A
file in /dev/shm is also registered with multiprocessing's resource tracker, so a process killed
before it could unlink its files (SIGTERM, SIGKILL) still leaves none behind.
"""
from __future__ import annotations

import atexit
import itertools
import json
import os
import shutil
import tempfile
from multiprocessing import resource_tracker
from dataclasses import dataclass
from pathlib import Path

import torch

from .lora_adapter import LoRAAdapter

SHM_DIR = Path("/dev/shm")
_counter = itertools.count()
_live: set[str] = set()  # files this process made and has not unlinked (removed at exit)
_DTYPES = {str(d): d for d in (torch.float16, torch.bfloat16, torch.float32, torch.float64)}


@dataclass(frozen=True, slots=True)
class SharedLayout:
    """Where an adapter's tensors lie in its shared file: what a helper needs to map them."""

    path: str
    dtype: str
    rank: int
    numel: int
    # (layer, target, A offset, A rows, A cols, B offset, B rows, B cols), offsets in elements
    tensors: tuple[tuple[int, str, int, int, int, int, int, int], ...]

    def encode(self) -> str:
        return json.dumps({"path": self.path, "dtype": self.dtype, "rank": self.rank, "numel": self.numel,
                           "tensors": [list(t) for t in self.tensors]}, separators=(",", ":"))

    @classmethod
    def decode(cls, text: str) -> SharedLayout:
        raw = json.loads(text)
        return cls(raw["path"], raw["dtype"], int(raw["rank"]), int(raw["numel"]),
                   tuple((int(t[0]), str(t[1]), *map(int, t[2:])) for t in raw["tensors"]))


def _directory(nbytes: int) -> Path:
    """/dev/shm when it has room for the file (a container's is often 64 MiB), else the temp dir."""
    override = os.environ.get("TIDAL_LORA_SHM_DIR")
    if override:
        return Path(override)
    if SHM_DIR.is_dir() and shutil.disk_usage(SHM_DIR).free > 2 * nbytes + (64 << 20):
        return SHM_DIR
    return Path(tempfile.gettempdir())


def share(adapter: LoRAAdapter) -> tuple[LoRAAdapter, SharedLayout]:
    """A copy of a host adapter whose tensors are views of one new shared file, and its layout."""
    dtypes = {a.dtype for a, _ in adapter.weights.values()} | {b.dtype for _, b in adapter.weights.values()}
    if len(dtypes) > 1:
        raise ValueError(f"adapter {adapter.name!r} mixes dtypes {dtypes}")
    dtype = dtypes.pop() if dtypes else torch.float32
    numel = sum(a.numel() + b.numel() for a, b in adapter.weights.values())
    size = max(1, numel) * torch.empty((), dtype=dtype).element_size()
    path = _directory(size) / f"tidal-lora-{os.getpid()}-{next(_counter)}"
    with open(path, "wb") as f:
        f.truncate(size)
    _live.add(str(path))
    _track(path, True)
    flat = torch.from_file(str(path), shared=True, size=max(1, numel), dtype=dtype)
    weights, layout, at = {}, [], 0
    for (layer, target), (a, b) in sorted(adapter.weights.items()):
        av = flat[at:at + a.numel()].view(a.shape)
        av.copy_(a)
        bv = flat[at + a.numel():at + a.numel() + b.numel()].view(b.shape)
        bv.copy_(b)
        weights[(layer, target)] = (av, bv)
        layout.append((layer, target, at, a.shape[0], a.shape[1], at + a.numel(), b.shape[0], b.shape[1]))
        at += a.numel() + b.numel()
    return LoRAAdapter(adapter.name, adapter.rank, weights), SharedLayout(str(path), str(dtype), adapter.rank,
                                                                           max(1, numel), tuple(layout))


def attach(layout: SharedLayout) -> dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]:
    """A helper's views of an adapter's shared tensors (no copy, no directory read)."""
    flat = torch.from_file(layout.path, shared=True, size=layout.numel, dtype=_DTYPES[layout.dtype])
    return {(layer, target): (flat[ao:ao + ar * ac].view(ar, ac), flat[bo:bo + br * bc].view(br, bc))
            for layer, target, ao, ar, ac, bo, br, bc in layout.tensors}


def _track(path: Path, on: bool) -> None:
    """The resource tracker unlinks a /dev/shm name this process leaked (it outlives a kill)."""
    if path.parent != SHM_DIR:
        return
    try:
        (resource_tracker.register if on else resource_tracker.unregister)("/" + path.name, "shared_memory")
    except Exception:  # noqa: BLE001 - best effort: the atexit cleanup still runs on a normal exit
        pass


def release(layout: SharedLayout) -> None:
    """Unlink the file: mappings still open stay valid until they close."""
    if layout.path not in _live:
        return
    _live.discard(layout.path)
    _track(Path(layout.path), False)
    try:
        os.unlink(layout.path)
    except FileNotFoundError:
        pass


@atexit.register
def _cleanup() -> None:
    for path in list(_live):
        _track(Path(path), False)
        try:
            os.unlink(path)
        except OSError:
            pass
    _live.clear()


__all__ = ["SharedLayout", "attach", "release", "share"]
