"""The device's copy rates and load times for `tidal profile gpu` (gpu_profile.py).

Every function returns the number and the sentence saying how it was measured, which becomes the
field's `FieldSource` in the written profile. On CUDA each timing brackets the work with
`torch.cuda.synchronize()`; on a CPU "device" the same code times host memory copies, and the
method says so (there is no pinned/pageable distinction and no PCIe link on a CPU).
"""
from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch

MiB = 1 << 20


def is_cuda(device: str) -> bool:
    return device.startswith("cuda")


def _sync(device: str) -> None:
    if is_cuda(device):
        torch.cuda.synchronize(device)


def timed(fn: Callable[[], object], device: str, repeats: int) -> float:
    """The fastest of `repeats` runs of `fn`, synchronized on the device (one untimed warm-up)."""
    fn()
    _sync(device)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        _sync(device)
        best = min(best, time.perf_counter() - start)
    return best


def host_buffer(nbytes: int, pinned: bool) -> torch.Tensor:
    return torch.empty(nbytes, dtype=torch.uint8, pin_memory=pinned).fill_(1)


def copy_rates(device: str, nbytes: int, repeats: int) -> dict[str, tuple[float, str]]:
    """h2d/d2h x pageable/pinned bytes per second, each with its method."""
    cuda = is_cuda(device)
    dev = torch.empty(nbytes, dtype=torch.uint8, device=device).fill_(2)
    out: dict[str, tuple[float, str]] = {}
    for pinned in (False, True):
        host = host_buffer(nbytes, pinned and cuda)
        kind = "pinned" if pinned else "pageable"
        for direction, fn in (("h2d", lambda: dev.copy_(host, non_blocking=pinned)),
                              ("d2h", lambda: host.copy_(dev, non_blocking=pinned))):
            seconds = timed(fn, device, repeats)
            if cuda:
                how = (f"{nbytes // MiB} MiB {kind} host tensor {'to' if direction == 'h2d' else 'from'} {device}, "
                       f"fastest of {repeats} synchronized copies")
            else:
                how = (f"CPU memcpy standing in for {direction} {kind} (no device link on a CPU): {nbytes // MiB} MiB "
                       f"tensor copy, fastest of {repeats}")
            out[f"{direction}_{kind}"] = (nbytes / seconds, how)
        del host
    return out


def kv_block_copy(device: str, block_bytes: int, blocks: int, repeats: int) -> tuple[float, str]:
    """Bytes per second of gathering `blocks` scattered KV blocks into a contiguous region (the
    swap/migration path's export), on the device."""
    elems = max(1, block_bytes // 2)
    pool = torch.empty(blocks * 4, elems, dtype=torch.bfloat16, device=device).normal_()
    idx = torch.randperm(blocks * 4, device=device)[:blocks]
    dst = torch.empty(blocks, elems, dtype=torch.bfloat16, device=device)
    seconds = timed(lambda: torch.index_select(pool, 0, idx, out=dst), device, repeats)
    how = (f"index_select of {blocks} random blocks of {block_bytes // 1024} KiB (one layer's K+V for 16 tokens of "
           f"the profiled 8B geometry) out of a {4 * blocks}-block pool into a contiguous region on {device}, "
           f"fastest of {repeats}; bytes counted once (read + write is twice that)")
    return blocks * elems * 2 / seconds, how


def adapter_load(device: str, layers: int, hidden: int, rank: int, repeats: int) -> tuple[float, int, str]:
    """Seconds to copy one LoRA adapter (q, k, v at `rank`, every layer, bf16) from pageable host
    memory to the device, its bytes, and the method."""
    host = [torch.empty(rank, hidden, dtype=torch.bfloat16).normal_() for _ in range(layers * 3 * 2)]
    nbytes = sum(t.numel() * 2 for t in host)
    dev = [torch.empty_like(t, device=device) for t in host]

    def load() -> None:
        for d, h in zip(dev, host):
            d.copy_(h)

    seconds = timed(load, device, repeats)
    what = "host -> " + device if is_cuda(device) else "CPU memcpy (no device)"
    how = (f"{layers} layers x q,k,v x (A, B) at rank {rank}, hidden {hidden}, bf16 = {nbytes / MiB:.0f} MiB in "
           f"{len(host)} pageable tensors, {what}, fastest of {repeats}")
    return seconds, nbytes, how


def median_after_first(times: list[float]) -> tuple[float, float]:
    """(the first time, the median of the rest): a capture step against its replays."""
    if len(times) < 2:
        raise ValueError("need a first step and at least one more")
    return times[0], statistics.median(times[1:])


__all__ = ["MiB", "adapter_load", "copy_rates", "host_buffer", "is_cuda", "kv_block_copy", "median_after_first",
           "timed"]
