"""Physical paged KV storage.

One block holds ONE layer's K and V for `block_size` tokens: [2, block_size, kv_heads,
head_dim]. Blocks are not tied to layers, so the block manager can give any free block to
any layer (per-layer block tables) and move a request's KV layer by layer.

Physically the K halves of all blocks form one contiguous array and the V halves
another ([2, max_blocks, block_size, kv_heads, d]), so gathering a batch's blocks is a
row copy (`index_select`) — ~30x faster on CPU than indexing interleaved K/V.

The storage is a view over a region reserved for the pool's maximum possible number of
blocks (`gpu_ext.memory`): only blocks that are written get physical memory, and when
the pool grows (weights dropped) the new block ids are already addressable — nothing is
reallocated or copied.

Token slot of (block b, offset o) = b * block_size + o, in both the K and the V array.
"""
from __future__ import annotations

import torch

from gpu_ext.memory import ReservedRegion, reserve_region

from .model_config import ModelConfig


def kv_block_bytes(cfg: ModelConfig, block_size: int) -> int:
    itemsize = torch.empty((), dtype=cfg.dtype).element_size()
    return 2 * block_size * cfg.num_kv_heads * cfg.head_dim * itemsize


class PagedKVCache:
    def __init__(
        self, cfg: ModelConfig, max_blocks: int, block_size: int = 16, device: torch.device | str = "cpu"
    ) -> None:
        if max_blocks <= 0 or block_size <= 0:
            raise ValueError(f"need max_blocks > 0 and block_size > 0 (got {max_blocks}, {block_size})")
        self.cfg = cfg
        self.block_size = block_size
        self.max_blocks = max_blocks
        self.block_bytes = kv_block_bytes(cfg, block_size)
        self.region: ReservedRegion = reserve_region(max_blocks * self.block_bytes, device)
        shape = (2, max_blocks, block_size, cfg.num_kv_heads, cfg.head_dim)
        self.blocks = self.region.as_tensor(cfg.dtype, shape)
        self.keys = self.blocks[0]  # [max_blocks, block_size, kv_heads, d], contiguous
        self.values = self.blocks[1]
        slots = (max_blocks * block_size, cfg.num_kv_heads, cfg.head_dim)
        self.key_slots, self.value_slots = self.keys.view(slots), self.values.view(slots)
        self._key_rows = self.keys.view(max_blocks, -1)  # one row per block, for index_select
        self._value_rows = self.values.view(max_blocks, -1)

    # --- per step -----------------------------------------------------------------
    def write(self, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store new tokens' k/v [T, kv_heads, d] at their slots."""
        self.key_slots.index_copy_(0, slots, k)
        self.value_slots.index_copy_(0, slots, v)

    def gather(
        self, block_table: torch.Tensor, k_buf: torch.Tensor | None = None, v_buf: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """[..., n_blocks] block ids → K, V [..., n_blocks * block_size, kv_heads, d], copied
        into `k_buf`/`v_buf` (flat, large enough) when given."""
        shape = (*block_table.shape[:-1], block_table.shape[-1] * self.block_size, self.cfg.num_kv_heads,
                 self.cfg.head_dim)
        flat = block_table.reshape(-1)
        if k_buf is None or v_buf is None:
            return self._key_rows.index_select(0, flat).view(shape), self._value_rows.index_select(0, flat).view(shape)
        rows = (flat.numel(), self._key_rows.shape[1])
        k = torch.index_select(self._key_rows, 0, flat, out=k_buf[: rows[0] * rows[1]].view(rows))
        v = torch.index_select(self._value_rows, 0, flat, out=v_buf[: rows[0] * rows[1]].view(rows))
        return k.view(shape), v.view(shape)

    # --- moving a request's KV (the data plane carries the tensors) --------------
    def export_tokens(self, block_ids: list[int], num_tokens: int) -> torch.Tensor:
        """The first `num_tokens` tokens' KV of one layer → [2, num_tokens, kv_heads, d]."""
        self._check_cover(block_ids, num_tokens)
        k, v = self.gather(torch.tensor(block_ids, dtype=torch.long, device=self.blocks.device))
        return torch.stack([k[:num_tokens], v[:num_tokens]]).clone()

    def import_tokens(self, block_ids: list[int], data: torch.Tensor) -> None:
        """Write [2, num_tokens, kv_heads, d] (from `export_tokens`) into `block_ids`."""
        num_tokens = data.shape[1]
        expected = (2, num_tokens, self.cfg.num_kv_heads, self.cfg.head_dim)
        if tuple(data.shape) != expected:
            raise ValueError(f"KV import shape {tuple(data.shape)} does not match {expected}")
        self._check_cover(block_ids, num_tokens)
        pos = torch.arange(num_tokens, device=self.blocks.device)
        ids = torch.tensor(block_ids, dtype=torch.long, device=self.blocks.device)
        slots = ids[pos // self.block_size] * self.block_size + pos % self.block_size
        data = data.to(device=self.blocks.device, dtype=self.blocks.dtype)
        self.write(slots, data[0], data[1])

    def release_blocks(self, block_ids: list[int]) -> None:
        """Give free blocks' physical memory back (e.g. when capacity shrinks)."""
        half = self.block_bytes // 2  # a block's K and its V live in the two halves
        for b in block_ids:
            self.region.release(b * half, half)
            self.region.release((self.max_blocks + b) * half, half)

    def _check_cover(self, block_ids: list[int], num_tokens: int) -> None:
        if len(block_ids) * self.block_size < num_tokens:
            raise ValueError(f"{len(block_ids)} blocks of {self.block_size} cannot hold {num_tokens} tokens")
        if block_ids and not 0 <= min(block_ids) <= max(block_ids) < self.max_blocks:
            raise ValueError(f"block id out of range [0, {self.max_blocks})")
