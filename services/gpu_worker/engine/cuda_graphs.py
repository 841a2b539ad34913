"""CUDA graphs for decode steps: one graph per batch bucket, captured once, replayed per step.

A decode step launches a few hundred small kernels (per layer: norm, qkv, rope, KV write,
attention, o_proj, norm, MLP); from Python each launch costs microseconds of CPU, which at
small batch is longer than the GPU's work. A replay launches them all at once.

A graph reads its inputs from fixed addresses, so the step's metadata lives in static
buffers: token ids, positions (-1: a padding row of the bucket), a row map (batch row ->
table row) and the block tables of every KV layer, `tables` [L, R, W] int32. A sequence
keeps its table row while it decodes step after step; only the block ids it did not have
at its last graph step are written (one per layer when it crosses into a new block), by
one scatter. The KV write (`write_kv`, slot from the table and the position) and the
attention (`paged_decode`, split-K fixed per bucket, lengths read on the device) are
gpu_ext's Triton kernels, so nothing in a replay depends on host values. Per step the host
sends one small tensor (ids, positions, rows) and the table updates, pinned and copied
without blocking: a step never waits for the device; the caller's token fetch is the one sync.

Graphs hold the weights' and the KV's addresses: `reset` drops them when weights move
(drop/restore layers) or the KV layers change. A step runs eagerly (the caller's path)
when it is not a plain decode of the whole model: prefill tokens, LoRA, remote attention,
layers loading, more sequences than the largest bucket.

On a CPU device (the Triton interpreter's test) the same buffers and kernels run without a
capture: the body is called directly each step.
"""
from __future__ import annotations

from array import array
from bisect import bisect_left
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from .batch import ScheduledChunk

BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
MAX_TABLE_BYTES = 256 << 20  # the static block tables; fewer rows (a smaller largest bucket) above it


@dataclass(slots=True)
class _Row:
    index: int
    tables: dict[int, list[int]]  # the block manager's dict for the sequence (identity = same allocation)
    first: list[int]  # its first and last layer's lists: replaced when KV is re-imported
    last: list[int]
    written: int  # block ids of each layer already in the static table


class DecodeGraphs:
    def __init__(self, model, kv_cache, kv_layers: Sequence[int], sliding_window: int | None,
                 max_position: int) -> None:
        from gpu_ext.triton_attention import choose_splits

        self.model = model
        self.cache = kv_cache
        self.device = kv_cache.blocks.device
        self.layers = list(kv_layers)
        self.layer_index = {layer: i for i, layer in enumerate(self.layers)}
        self.window = sliding_window or 0
        self.block_size = kv_cache.block_size
        self.width = -(-max_position // self.block_size)
        per_row = max(1, len(self.layers) * self.width * 4)
        self.num_rows = min(BUCKETS[-1], max(1, MAX_TABLE_BYTES // per_row))
        self.buckets = [b for b in BUCKETS if b <= self.num_rows]
        dev = self.device
        self.tables = torch.zeros(len(self.layers), self.num_rows, self.width, dtype=torch.int32, device=dev)
        self.tokens = torch.zeros(self.buckets[-1], dtype=torch.long, device=dev)
        self.positions = torch.full((self.buckets[-1],), -1, dtype=torch.long, device=dev)
        self.rows = torch.zeros(self.buckets[-1], dtype=torch.long, device=dev)
        self.capture = dev.type == "cuda"
        # the split choice on CPU (interpreter test only): an H100's 132 SMs
        sms = torch.cuda.get_device_properties(dev).multi_processor_count if self.capture else 132
        kv_heads = kv_cache.cfg.num_kv_heads
        self.splits = {b: choose_splits(b, kv_heads, self.width * self.block_size, sms) for b in self.buckets}
        self._graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self._pool = None
        self._rows: dict[str, _Row] = {}
        self._free = list(range(self.num_rows - 1, -1, -1))
        self._n = 0  # rows of the bucket being captured (the attention's view of the buffers)
        self._ctx: torch.Tensor | None = None
        self.steps = 0  # steps run through the static buffers
        self.captures = 0

    # --- lifetime -------------------------------------------------------------------
    def reset(self) -> None:
        """Forget every graph and table row (weights moved, KV layers changed)."""
        self._graphs.clear()
        self._pool = None
        self._rows.clear()
        self._free = list(range(self.num_rows - 1, -1, -1))

    def graph_for(self, batch: int) -> torch.cuda.CUDAGraph | None:
        """The captured graph a step of `batch` sequences replays (None: not captured yet)."""
        i = bisect_left(self.buckets, batch)
        entry = self._graphs.get(self.buckets[i]) if i < len(self.buckets) else None
        return entry[0] if entry is not None else None

    def fits(self, chunks: Sequence[ScheduledChunk]) -> bool:
        """Whether the decode step fits a bucket and the tables (caller checks the rest)."""
        if not chunks or len(chunks) > self.buckets[-1]:
            return False
        limit = self.width * self.block_size
        return all(len(c.token_ids) == 1 and c.sample and c.adapter is None and c.start_pos < limit for c in chunks)

    # --- one step ---------------------------------------------------------------------
    def run(self, chunks: Sequence[ScheduledChunk]) -> torch.Tensor:
        """Logits [B, vocab] (float32, a view of the graph's output: read before the next step)."""
        n = len(chunks)
        bucket = self.buckets[bisect_left(self.buckets, n)]
        self.steps += 1
        if not self.capture:
            self._upload(chunks, bucket)
            return self._body(bucket)[:n]
        if bucket not in self._graphs:
            self._capture(bucket)
        self._upload(chunks, bucket)
        graph, logits = self._graphs[bucket]
        graph.replay()
        return logits[:n]

    def _upload(self, chunks: Sequence[ScheduledChunk], bucket: int) -> None:
        seen = {c.seq_id for c in chunks}
        for seq_id in [s for s in self._rows if s not in seen]:
            self._free.append(self._rows.pop(seq_id).index)
        bs, width, stride_layer = self.block_size, self.width, self.num_rows * self.width
        idx, vals = array("q"), array("i")
        meta = [0] * (3 * bucket)
        for b, c in enumerate(chunks):
            tables = c.block_tables
            first, last = tables[self.layers[0]], tables[self.layers[-1]]
            row = self._rows.get(c.seq_id)
            if row is None or row.tables is not tables or row.first is not first or row.last is not last:
                if row is None:
                    row = self._rows[c.seq_id] = _Row(self._free.pop(), tables, first, last, 0)
                row.tables, row.first, row.last, row.written = tables, first, last, 0
            need = c.start_pos // bs + 1
            if row.written < need:
                for li, layer in enumerate(self.layers):
                    base = li * stride_layer + row.index * width
                    idx.extend(range(base + row.written, base + need))
                    vals.extend(tables[layer][row.written:need])
                row.written = need
            meta[b] = c.token_ids[0]
            meta[bucket + b] = c.start_pos
            meta[2 * bucket + b] = row.index
        for b in range(len(chunks), bucket):
            meta[bucket + b] = -1  # padding rows: no KV write, context 0
        host = self._to_device(torch.tensor(meta, dtype=torch.long))
        self.tokens[:bucket].copy_(host[:bucket])
        self.positions[:bucket].copy_(host[bucket : 2 * bucket])
        self.rows[:bucket].copy_(host[2 * bucket :])
        if idx:
            self.tables.view(-1).index_copy_(
                0, self._to_device(torch.frombuffer(idx, dtype=torch.long)),
                self._to_device(torch.frombuffer(vals, dtype=torch.int32)))

    def _to_device(self, host: torch.Tensor) -> torch.Tensor:
        if not self.capture:
            return host
        # pinned: the host allocator keeps the block until its copy ran, so nothing waits
        return host.pin_memory().to(self.device, non_blocking=True)

    # --- capture ----------------------------------------------------------------------
    def _body(self, n: int) -> torch.Tensor:
        model = self.model
        self._n = n
        positions = self.positions[:n]
        self._ctx = (positions + 1).to(torch.int32)  # padding rows (-1): context 0
        hidden = model.embed_tokens(self.tokens[:n])
        hidden = model.run_layers(self.layers[0], self.layers[-1] + 1, hidden, positions, self)
        return model.compute_logits(hidden).float()

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """The graph's attention (a `LayerAttention`) over the static buffers."""
        from gpu_ext.triton_attention import paged_decode, write_kv

        n, table = self._n, self.tables[self.layer_index[layer]]
        rows = self.rows[:n]
        write_kv(k, v, self.cache.keys, self.cache.values, table, rows, self.positions[:n])
        assert self._ctx is not None
        return paged_decode(q, self.cache.keys, self.cache.values, table, self._ctx, q.shape[-1] ** -0.5,
                            self.window, rows=rows, num_splits=self.splits[n])

    def _capture(self, n: int) -> None:
        self.positions[:n].fill_(-1)  # warm-up and capture as padding rows: no KV is written
        self.tokens[:n].zero_()
        self.rows[:n].zero_()
        main = torch.cuda.current_stream(self.device)
        side = torch.cuda.Stream(self.device)
        side.wait_stream(main)
        with torch.cuda.stream(side):  # compiles the kernels, sets up cuBLAS, outside the capture
            for _ in range(2):
                self._body(n)
        main.wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            logits = self._body(n)
        if self._pool is None:
            self._pool = graph.pool()
        self._graphs[n] = (graph, logits)
        self.captures += 1
