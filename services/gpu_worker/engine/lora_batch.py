"""The step's multi-LoRA computation: two batched paths, same numbers.

- padded (BGMV-style, Punica): every adapter of the batch is zero-padded to the batch's
  max rank and stacked; each token gathers its adapter's A and B and one batched matmul
  does shrink, one does expand. Cost ∝ tokens × max rank, one op regardless of adapters.
- segmented (MBGMV-style, S-LoRA): tokens are grouped by adapter once per step; each
  group multiplies by its adapter's own A and B. Cost ∝ Σ tokens × own rank, one op pair
  per adapter present.

Tokens without an adapter are skipped by both. Deltas are added in place into the base
projection's output (which may be a view into the fused qkv / gate-up output).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .lora_adapter import LoRAAdapter


@dataclass(slots=True)
class SegmentedLoRABatch:
    adapters: dict[str, LoRAAdapter]
    segments: list[tuple[str, torch.Tensor | slice]]  # adapter -> its token rows

    def start(self, layer: int, targets: object, x: torch.Tensor) -> None:
        """Nothing to begin early on the device (the CPU-assisted hook overlaps here)."""

    def add(self, layer: int, target: str, x: torch.Tensor, out: torch.Tensor) -> None:
        for name, rows in self.segments:
            ab = self.adapters[name].weights.get((layer, target))
            if ab is None:
                continue
            a, b = ab
            if isinstance(rows, slice):
                out[rows] += (x[rows] @ a.t()) @ b.t()
            else:
                out.index_add_(0, rows, (x.index_select(0, rows) @ a.t()) @ b.t())


@dataclass(slots=True)
class PaddedLoRABatch:
    names: list[str]
    adapters: dict[str, LoRAAdapter]
    rows: torch.Tensor | None  # tokens that have an adapter (None: all of them)
    slot: torch.Tensor  # per selected token: index into the stacked weights
    max_rank: int
    stacks: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor] | None]

    def start(self, layer: int, targets: object, x: torch.Tensor) -> None:
        """Nothing to begin early on the device (the CPU-assisted hook overlaps here)."""

    def _stack(self, layer: int, target: str) -> tuple[torch.Tensor, torch.Tensor] | None:
        key = (layer, target)
        if key not in self.stacks:
            present = [self.adapters[n].weights.get(key) for n in self.names]
            ref = next((ab for ab in present if ab is not None), None)
            if ref is None:
                self.stacks[key] = None
            else:
                a0, b0 = ref
                a_st = a0.new_zeros(len(self.names), self.max_rank, a0.shape[1])
                b_st = b0.new_zeros(len(self.names), b0.shape[0], self.max_rank)
                for i, ab in enumerate(present):
                    if ab is not None:
                        a_st[i, : ab[0].shape[0]] = ab[0]
                        b_st[i, :, : ab[1].shape[1]] = ab[1]
                self.stacks[key] = (a_st, b_st)
        return self.stacks[key]

    def add(self, layer: int, target: str, x: torch.Tensor, out: torch.Tensor) -> None:
        stack = self._stack(layer, target)
        if stack is None:
            return
        a_st, b_st = stack
        xs = x if self.rows is None else x.index_select(0, self.rows)
        shrink = torch.bmm(a_st[self.slot], xs.unsqueeze(-1))  # [T, max_rank, 1]
        delta = torch.bmm(b_st[self.slot], shrink).squeeze(-1)  # [T, out]
        if self.rows is None:
            out += delta
        else:
            out.index_add_(0, self.rows, delta)


LoRABatch = SegmentedLoRABatch | PaddedLoRABatch


def build_lora_batch(
    mode: str,
    names: list[str],
    adapters: dict[str, LoRAAdapter],
    per_chunk: list[str | None],
    q_lens: list[int],
    device: torch.device,
    stacks: dict | None,
) -> LoRABatch:
    token_names: list[str | None] = []
    for name, n in zip(per_chunk, q_lens):
        token_names.extend([name] * n)
    if mode == "segmented":
        segments: list[tuple[str, torch.Tensor | slice]] = []
        for name in names:
            idx = [i for i, t in enumerate(token_names) if t == name]
            if idx[-1] - idx[0] + 1 == len(idx):
                segments.append((name, slice(idx[0], idx[-1] + 1)))
            else:
                segments.append((name, torch.tensor(idx, dtype=torch.long, device=device)))
        return SegmentedLoRABatch(adapters, segments)
    if mode == "padded":
        index = {n: i for i, n in enumerate(names)}
        sel = [i for i, t in enumerate(token_names) if t is not None]
        rows = None if len(sel) == len(token_names) else torch.tensor(sel, dtype=torch.long, device=device)
        slot = torch.tensor([index[token_names[i]] for i in sel], dtype=torch.long, device=device)
        max_rank = max(adapters[n].rank for n in names)
        return PaddedLoRABatch(names, adapters, rows, slot, max_rank, stacks if stacks is not None else {})
    raise ValueError(f"unknown LoRA mode {mode!r} (padded or segmented)")
