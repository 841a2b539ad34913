"""A typed tensor over a region's bytes: shared by the CPU and CUDA regions (gpu_ext.memory,
gpu_ext.cuda_vmm) without either importing the other's module back."""
from __future__ import annotations

import torch


def typed_view(region_bytes: torch.Tensor, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    """A `dtype` tensor of `shape` over the start of a region's flat uint8 tensor (no copy)."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    count = 1
    for n in shape:
        count *= n
    if count * itemsize > region_bytes.numel():
        raise ValueError(f"view of {count * itemsize} bytes exceeds the region ({region_bytes.numel()})")
    return region_bytes[: count * itemsize].view(dtype).view(shape)
