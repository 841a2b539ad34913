"""The step's LoRA hook when some chunks' adapters are still on their way to the device.

Chunks flagged `lora_on_cpu` (prefill of a request whose adapter is loading) get their deltas
from the CPU helpers; every other chunk from the device path (`lora_batch`), as usual. Per
layer and projection group: `start` (called before the base matmul) packs the cold rows into
the shared input region and signals the helpers, the base projection runs meanwhile, and the
first `add` of the group waits for the helpers and adds their columns into the cold rows.

Only the groups some cold adapter targets go to the helpers (`groups`): an adapter on q/k/v
costs one helper call per layer, not four, and only the targets it has get a delta added.

Mid-step takeover (issue 31): at each layer boundary (the first `start` of a layer, when no helper
call is in flight) the hook asks `LoRAManager.landing(names, layer)` whether the loads of its cold
adapters have landed; those that have are made resident there (cold_start.py), and from that layer
on their rows take the device path (`taken`, the manager's kernel) within the same step — the
helpers get only the rows still cold, or no call at all. The earliest point: inside a layer the
deltas of a group are already in flight on the helpers and its base projection is running; between
layers every cold row's hidden state is final, so switching the path of the next layers is exact
(the same x·A·B on the device, in the device's arithmetic).
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
                 segments: list[Segment], targets: set[str] | None = None, *, lora: LoRAManager | None = None,
                 chunks: Sequence[ScheduledChunk] = (), q_lens: Sequence[int] = ()) -> None:
        self.device = device
        self.helpers = helpers
        self._set_cold(rows, segments, targets)
        self.calls = 0  # helper calls made (one per layer and targeted group)
        self._tickets: dict[int, tuple[int, Ticket]] = {}  # group -> (layer, its call in flight)
        self._results: dict[tuple[int, int], torch.Tensor] = {}  # (layer, group) -> deltas (shared region)
        self._lora, self._chunks, self._q_lens = lora, list(chunks), list(q_lens)
        self._checked = -1  # the last layer whose boundary asked for landed loads
        self.taken: LoRABatch | None = None  # rows of cold adapters whose load landed during the step
        self.taken_at: dict[str, int] = {}  # adapter -> the layer from which the device computed its rows

    def _set_cold(self, rows: torch.Tensor | slice | None, segments: list[Segment], targets: set[str] | None) -> None:
        self.rows = rows
        self.segments = segments
        self.targets = set(GROUP_OF) if targets is None else set(targets)  # what the cold adapters adapt
        self.groups = {GROUP_OF[t] for t in self.targets} if segments else set()

    def _cold(self, x: torch.Tensor) -> torch.Tensor:
        return x[self.rows] if isinstance(self.rows, slice) else x.index_select(0, self.rows)

    def _boundary(self, layer: int) -> None:
        """Between layers: cold adapters whose load landed go to the device path from `layer` on."""
        self._checked = layer
        landing = self._lora.landing if self._lora is not None else None
        cold = {s.adapter for s in self.segments}
        if landing is None or not cold or self._tickets:
            return
        landed = landing(cold, layer) & cold
        if not landed:
            return
        for name in landed:
            self.taken_at[name] = layer
        moved = set(self.taken_at)
        names = [c.adapter if c.lora_on_cpu and c.adapter in moved else None for c in self._chunks]
        self.taken = self._lora.prepare_batch(names, self._q_lens)
        self._results.clear()
        still = [c.lora_on_cpu and c.adapter not in moved for c in self._chunks]
        packed = _pack(self._lora, self._chunks, self._q_lens, still)
        if packed is None:
            self._set_cold(None, [], set())  # every cold adapter landed: no more helper calls this step
        else:
            self._set_cold(*packed)

    def start(self, layer: int, targets: Sequence[str], x: torch.Tensor) -> None:
        if layer != self._checked:
            self._boundary(layer)
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
        if self.taken is not None:
            self.taken.add(layer, target, x, out)
        if target not in self.targets or not self.segments:
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


def _pack(lora: LoRAManager, chunks: Sequence[ScheduledChunk], q_lens: Sequence[int],
          on_cpu: Sequence[bool]) -> tuple[torch.Tensor | slice, list[Segment], set[str]] | None:
    """The rows of the chunks flagged in `on_cpu`, packed for the helpers: (their index in the step's
    tokens, segments per adapter, the targets they adapt); None when no chunk is flagged."""
    rows: list[int] = []
    segments: list[Segment] = []
    targets: set[str] = set()
    at = 0
    for c, n, cpu in zip(chunks, q_lens, on_cpu):
        if cpu:
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
    if not rows:
        return None
    contiguous = rows[-1] - rows[0] + 1 == len(rows)
    index: torch.Tensor | slice = (slice(rows[0], rows[-1] + 1) if contiguous
                                   else torch.tensor(rows, dtype=torch.long, device=lora.device))
    return index, segments, targets


def step_hook(lora: LoRAManager, helpers: CpuLoRAHelpers | None, chunks: list[ScheduledChunk],
              q_lens: list[int]) -> LoRABatch | CpuAssistedLoRA | None:
    """The LoRA hook of one step: the device path for resident adapters, helpers for flagged chunks."""
    device_names = [None if c.lora_on_cpu else c.adapter for c in chunks]
    device = lora.prepare_batch(device_names, q_lens) if any(n is not None for n in device_names) else None
    packed = _pack(lora, chunks, q_lens, [c.lora_on_cpu for c in chunks])
    if packed is None:
        return device
    if helpers is None:
        raise RuntimeError("chunks flagged for CPU LoRA but this engine runs no helpers")
    index, segments, targets = packed
    return CpuAssistedLoRA(device, helpers, index, segments, targets, lora=lora, chunks=chunks, q_lens=q_lens)
