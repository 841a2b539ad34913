"""The step's LoRA hook when some chunks' adapters are still on their way to the device.

Chunks flagged `lora_on_cpu` (prefill of a request whose adapter is loading) get their deltas
from the CPU helpers; every other chunk from the device path (`lora_batch`), as usual. Per
layer and projection group: `start` (called before the base matmul) packs the cold rows into
the shared input region and signals the helpers, the base projection runs meanwhile, and the
first `add` of the group waits for the helpers and adds their columns into the cold rows.

Only the groups some cold adapter targets go to the helpers (`groups`): an adapter on q/k/v
costs one helper call per layer, not four, and only the targets it has get a delta added.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from .batch import ScheduledChunk
from .cpu_lora_helpers import CpuLoRAHelpers, Segment, Ticket
from .cpu_lora_wire import GROUP_OF, group_layout

if TYPE_CHECKING:
    from .lora import LoRAManager
    from .lora_batch import LoRABatch


class CpuAssistedLoRA:
    def __init__(self, device: LoRABatch | None, helpers: CpuLoRAHelpers, rows: torch.Tensor | slice,
                 segments: list[Segment], targets: set[str] | None = None) -> None:
        self.device = device
        self.helpers = helpers
        self.rows = rows
        self.segments = segments
        self.targets = set(GROUP_OF) if targets is None else set(targets)  # what the cold adapters adapt
        self.groups = {GROUP_OF[t] for t in self.targets}
        self.calls = 0  # helper calls made (one per layer and targeted group)
        self._tickets: dict[int, tuple[int, Ticket]] = {}  # group -> (layer, its call in flight)
        self._results: dict[tuple[int, int], torch.Tensor] = {}  # (layer, group) -> deltas (shared region)

    def _cold(self, x: torch.Tensor) -> torch.Tensor:
        return x[self.rows] if isinstance(self.rows, slice) else x.index_select(0, self.rows)

    def start(self, layer: int, targets: Sequence[str], x: torch.Tensor) -> None:
        if self.device is not None:
            self.device.start(layer, targets, x)
        group = GROUP_OF[targets[0]]
        if group not in self.groups:
            return
        self._results.clear()  # the next submit reuses the regions
        self.calls += 1
        self._tickets[group] = (layer, self.helpers.submit(layer, group, self._cold(x), self.segments))

    def add(self, layer: int, target: str, x: torch.Tensor, out: torch.Tensor) -> None:
        if self.device is not None:
            self.device.add(layer, target, x, out)
        if target not in self.targets:
            return
        group = GROUP_OF[target]
        deltas = self._results.get((layer, group))
        if deltas is None:
            started = self._tickets.pop(group, None)
            if started is None or started[0] != layer:  # a caller that did not `start`: ask now
                self._results.clear()
                self.calls += 1
                started = (layer, self.helpers.submit(layer, group, self._cold(x), self.segments))
            deltas = self._results[(layer, group)] = self.helpers.wait(started[1])
        _, cols = group_layout(self.helpers.cfg, group)
        at, width = next((a, w) for t, a, w in cols if t == target)
        delta = deltas[:, at:at + width].to(out.device)
        if isinstance(self.rows, slice):
            out[self.rows] += delta
        else:
            out.index_add_(0, self.rows, delta)


def step_hook(lora: LoRAManager, helpers: CpuLoRAHelpers | None, chunks: list[ScheduledChunk],
              q_lens: list[int]) -> LoRABatch | CpuAssistedLoRA | None:
    """The LoRA hook of one step: the device path for resident adapters, helpers for flagged chunks."""
    device_names = [None if c.lora_on_cpu else c.adapter for c in chunks]
    device = lora.prepare_batch(device_names, q_lens) if any(n is not None for n in device_names) else None
    cold = [(c, n) for c, n in zip(chunks, q_lens) if c.lora_on_cpu]
    if not cold:
        return device
    if helpers is None:
        raise RuntimeError("chunks flagged for CPU LoRA but this engine runs no helpers")
    rows: list[int] = []
    segments: list[Segment] = []
    targets: set[str] = set()
    at = 0
    for c, n in zip(chunks, q_lens):
        if c.lora_on_cpu:
            assert c.adapter is not None
            packed = len(rows)
            rows.extend(range(at, at + n))
            last = segments[-1] if segments else None
            if last is not None and last.adapter == c.adapter and last.row + last.count == packed:
                segments[-1] = Segment(last.adapter, last.rank, last.row, last.count + n)
            else:
                adapter = lora.host[c.adapter]
                segments.append(Segment(c.adapter, adapter.rank, packed, n))
                targets.update(t for _, t in adapter.weights)
        at += n
    contiguous = rows[-1] - rows[0] + 1 == len(rows)
    index: torch.Tensor | slice = (slice(rows[0], rows[-1] + 1) if contiguous
                                   else torch.tensor(rows, dtype=torch.long, device=lora.device))
    return CpuAssistedLoRA(device, helpers, index, segments, targets)
