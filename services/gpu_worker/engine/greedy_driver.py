"""A minimal greedy driver for model runners: no scheduler, no sampling parameters.

It runs a fixed set of sequences to completion through a chain of runners (one runner,
or pipeline stages), each with its own block manager, optionally with some layers'
attention on separate KV holders (remote attention). Every step it gives each sequence
its next prefill chunk (at most `chunk` tokens) or its decode token, executes the
stages in order and appends the argmax. Tests use it as the reference loop around the
runner; the micro-benchmark uses it to time decode steps. The serving loop is engine.py.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .attention import PagedAttention
from .batch import ScheduledChunk, SchedulerOutput
from .block_manager import BlockManager
from .model_runner import ModelRunner


@dataclass(slots=True)
class DriverSeq:
    tokens: list[int]
    prompt_len: int
    adapter: str | None = None
    computed: int = 0
    logits: list[torch.Tensor] = field(default_factory=list)  # one per sampled token

    @property
    def output(self) -> list[int]:
        return self.tokens[self.prompt_len :]


@dataclass(slots=True)
class RemoteKV:
    """A KV holder for some layers: its attention object and its own block manager."""

    attention: PagedAttention
    blocks: BlockManager


class GreedyDriver:
    def __init__(
        self,
        stages: list[tuple[ModelRunner, BlockManager]],
        remote: dict[int, RemoteKV] | None = None,
    ) -> None:
        self.stages = stages
        self.remote = remote or {}
        holders = {id(r): r for r in self.remote.values()}
        self._holders = list(holders.values())
        for layer, holder in self.remote.items():
            runner = next((r for r, _ in stages if layer in r.layers), None)
            if runner is None:
                raise ValueError(f"no stage holds layer {layer}")
            runner.set_attention(layer, holder.attention)
        self.seqs: dict[str, DriverSeq] = {}

    def add(self, seq_id: str, prompt: list[int], adapter: str | None = None) -> None:
        self.seqs[seq_id] = DriverSeq(list(prompt), len(prompt), adapter)

    def _chunks(self, blocks: BlockManager, plan: list[tuple[str, int, int]]) -> list[ScheduledChunk]:
        out = []
        for seq_id, start, end in plan:
            if not blocks.allocate(seq_id, end):
                raise MemoryError(f"out of KV blocks for {seq_id} ({blocks.num_free_blocks} free)")
            seq = self.seqs[seq_id]
            tokens = seq.tokens[start:end]
            out.append(ScheduledChunk(seq_id, tokens, start, blocks.block_tables(seq_id), seq.adapter,
                                      end == len(seq.tokens)))
        return out

    def step(self, chunk: int | None = None, seq_ids: list[str] | None = None) -> list[str]:
        """One step over `seq_ids` (default: all); returns the ids that got a token."""
        plan = []
        for seq_id in seq_ids if seq_ids is not None else list(self.seqs):
            seq = self.seqs[seq_id]
            end = len(seq.tokens) if chunk is None else min(len(seq.tokens), seq.computed + chunk)
            plan.append((seq_id, seq.computed, end))
        for holder in self._holders:
            holder.attention.prepare(self._chunks(holder.blocks, plan))
        hidden = None
        result = None
        for runner, blocks in self.stages:
            result = runner.execute(SchedulerOutput(self._chunks(blocks, plan)), hidden)
            hidden = result.hidden
        assert result is not None
        for seq_id, _, end in plan:
            self.seqs[seq_id].computed = end
        for seq_id, logits in zip(result.sampled_seq_ids, result.logits if result.logits is not None else []):
            seq = self.seqs[seq_id]
            seq.logits.append(logits)
            seq.tokens.append(int(logits.argmax()))
        return result.sampled_seq_ids

    def generate(self, max_new_tokens: int, chunk: int | None = None) -> dict[str, list[int]]:
        """Run until every sequence has `max_new_tokens` outputs; returns the outputs."""
        while True:
            active = [s for s, q in self.seqs.items() if len(q.output) < max_new_tokens]
            if not active:
                return {s: q.output for s, q in self.seqs.items()}
            self.step(chunk, active)

    def free(self, seq_id: str) -> None:
        self.seqs.pop(seq_id, None)
        for _, blocks in self.stages:
            blocks.free(seq_id)
        for holder in self._holders:
            holder.blocks.free(seq_id)
