"""The model runner: weights of a layer range, the paged KV cache, LoRA — and one step.

`execute(SchedulerOutput)` turns the scheduler's chunks into one batched forward: every
token of the step goes through each projection in a single matmul; attention batches
all decode sequences in one SDPA. A runner may hold any contiguous layer range
(pipeline stage: the first holds the embedding, the last norm + lm_head) and may route
chosen layers' attention to another object that holds that layer's KV (remote
attention, `set_attention`).

Residency: `drop_layers` releases a layer range's weight charges to the pool (the block
manager turns the bytes into KV blocks in the same step; the KV region is reserved for
the pool's maximum so nothing is copied) keeping a host copy or re-reading from the
checkpoint on `restore_layers`.

Preloaded weights (`preloaded`, engine/preloaded.py: an evicted instance's or prewarmed layers
already in device memory) are taken as they are, without a copy or a checkpoint read; with
`background_load`, layers not preloaded are read by a `LayerLoader` thread while the runner
already steps (a step waits for each layer it reaches).
"""
from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from gpu_ext.linear import huge_pages, pack_weight, weight_nbytes

from .attention import PagedAttention
from .batch import SchedulerOutput
from .kv_cache import PagedKVCache, kv_block_bytes
from .loader import CheckpointReader
from .cpu_lora_batch import step_hook
from .cpu_lora_helpers import CpuLoRAHelpers
from .cuda_graphs import DecodeGraphs
from .lora import LoRAManager
from .model_config import ModelConfig, load_model_config
from .models.llama import LayerAttention, LayerWeights, LlamaModel
from .preloaded import LayerLoader, PreloadedWeights


@dataclass(slots=True)
class StepOutput:
    """`logits` [n, vocab] (float32) for chunks with sample=True, in chunk order, on the
    last stage; `hidden` [T, hidden] for the next stage otherwise."""

    logits: torch.Tensor | None
    hidden: torch.Tensor | None
    sampled_seq_ids: list[str]


def _as_layers(layers: Iterable[int]) -> range | list[int]:
    """A range when contiguous (what the block manager takes), else the sorted list."""
    if isinstance(layers, range):
        return layers
    held = sorted(layers)
    if held and held == list(range(held[0], held[-1] + 1)):
        return range(held[0], held[-1] + 1)
    return held


def _nbytes(*tensors: torch.Tensor) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


class ModelRunner:
    def __init__(
        self,
        model_dir: str | Path,
        pool: Any,
        *,
        layers: range | None = None,
        kv_layers: Iterable[int] | None = None,
        block_size: int = 16,
        dtype: str | torch.dtype | None = None,
        device: str | torch.device = "cpu",
        lora_mode: str = "segmented",
        max_loras: int | None = None,
        keep_host_copy: bool = True,
        num_threads: int | None = None,
        preloaded: PreloadedWeights | None = None,
        background_load: bool = False,
        cuda_graphs: bool | None = None,
    ) -> None:
        """`cuda_graphs`: replay decode steps from CUDA graphs (engine/cuda_graphs.py; default: on CUDA)."""
        if num_threads:
            torch.set_num_threads(num_threads)
        self.cfg: ModelConfig = load_model_config(model_dir, dtype)
        cfg = self.cfg
        self.layers = layers if layers is not None else range(cfg.num_layers)
        if self.layers.step != 1 or not 0 <= self.layers.start <= self.layers.stop <= cfg.num_layers:
            raise ValueError(f"layer range {self.layers} is not a contiguous range within 0..{cfg.num_layers}")
        self.kv_layers = _as_layers(kv_layers) if kv_layers is not None else self.layers
        self.device = torch.device(device)
        self.pool = pool
        self.keep_host_copy = keep_host_copy
        self.reader = CheckpointReader(model_dir, cfg)
        self.model = LlamaModel(cfg, self.device)
        self._charges: dict[str, Any] = {}
        self._host_layers: dict[int, LayerWeights] = dict(preloaded.layers) if preloaded is not None else {}
        self._preloaded = preloaded
        self.loading: LayerLoader | None = None  # layers still arriving (background_load)
        self._load_stage_ends()
        self._preloaded = None
        later = [i for i in self.layers if background_load and i not in self._host_layers]
        for i in self.layers:
            if i not in later:
                self._load_layer(i)
        if later:
            self.loading = LayerLoader(self, later)

        self.block_size = block_size
        self.kv_block_bytes = kv_block_bytes(cfg, block_size)
        # Reserve for every block the pool could ever hold (address space only, see gpu_ext).
        self.max_kv_blocks = max(1, pool.capacity_bytes // self.kv_block_bytes)
        self.kv_cache = PagedKVCache(cfg, self.max_kv_blocks, block_size, self.device)
        self.attention = PagedAttention(self.kv_cache, list(self.kv_layers), cfg.sliding_window)
        self._attention_override: dict[int, LayerAttention] = {}
        self.lora = LoRAManager(cfg, self.layers, pool, self.device, lora_mode, max_loras)
        self.cpu_lora: CpuLoRAHelpers | None = None  # set by the engine when it runs CPU LoRA helpers
        self.use_graphs = self.device.type == "cuda" if cuda_graphs is None else cuda_graphs
        if self.use_graphs and self.device.type != "cuda":
            raise ValueError(f"CUDA graphs need a CUDA device, not {self.device}")
        self.graphs: DecodeGraphs | None = None  # built at the first step that can replay

    # --- loading and residency ------------------------------------------------------
    def _charge(self, owner: str, nbytes: int) -> None:
        self._charges[owner] = self.pool.charge("weights", f"{self.cfg.name}:{owner}", nbytes)

    def _release(self, owner: str) -> int:
        handle = self._charges.pop(owner, None)
        return int(self.pool.release(handle) or 0) if handle is not None else 0

    def _load_stage_ends(self) -> None:
        m, r, pre = self.model, self.reader, self._preloaded
        if self.layers.start == 0:
            if pre is not None and pre.embed is not None:
                m.embed = pre.embed
            else:  # the tied lm_head too: every decode step reads it whole
                m.embed = huge_pages([r.read_embedding().to(self.device)])[0]
            self._charge("embed", _nbytes(m.embed))
        if self.layers.stop == self.cfg.num_layers:
            if pre is not None and pre.final_norm is not None and pre.lm_head is not None:
                m.final_norm, m.lm_head = pre.final_norm, pre.lm_head  # packed already
            else:
                m.final_norm = r.read_final_norm().to(self.device)
                m.lm_head = None
            if m.lm_head is not None:
                pass
            elif self.cfg.tie_word_embeddings and m.embed is not None:
                m.lm_head = pack_weight(m.embed)  # the embedding itself unless packing copies it
            else:
                m.lm_head = pack_weight(huge_pages([r.read_lm_head().to(self.device)])[0])
            extra = 0 if m.lm_head is m.embed else weight_nbytes(m.lm_head)
            self._charge("lm_head", _nbytes(m.final_norm) + extra)

    def _load_layer(self, i: int) -> None:
        host = self._host_layers.get(i)
        weights = host.to(self.device) if host is not None else LayerWeights.from_hf(self.reader.read_layer(i), self.device)
        self._charge(f"layer{i}", weights.nbytes)  # may raise (pool exhausted): the host copy stays
        self._host_layers.pop(i, None)
        self.model.layers[i] = weights

    def resident_layers(self) -> list[int]:
        return sorted(self.model.layers)

    @property
    def stage(self) -> range:
        """The layers `execute` runs: the resident ones, which must be contiguous (all of them
        while a background load is under way: a step waits for each)."""
        if self.loading is not None:
            return self.layers
        held = self.resident_layers()
        if not held:
            return range(self.layers.start, self.layers.start)
        if held[-1] - held[0] + 1 != len(held):
            raise RuntimeError(f"resident layers {held} are not contiguous: restore or drop to a range first")
        return range(held[0], held[-1] + 1)

    @property
    def is_first(self) -> bool:
        return self.model.embed is not None and self.stage.start == 0

    @property
    def is_last(self) -> bool:
        return self.model.lm_head is not None and self.stage.stop == self.cfg.num_layers

    def set_kv_layers(self, layers: Iterable[int]) -> None:
        """The layers whose KV this runner stores from now on (mirror of the block manager's
        held layers); other layers' attention must be routed elsewhere (`set_attention`)."""
        self.kv_layers = _as_layers(layers)
        self.attention.layers = list(self.kv_layers)
        self.graphs = None

    def drop_layers(self, start: int, end: int) -> int:
        """Free the weights of layers [start, end); returns the bytes released to the pool.
        On CPU the device is the host, so the kept host copy is the same memory: there the
        drop is the pool's accounting (capacity is a setting), as intended for tests."""
        released = 0
        for i in range(start, end):
            weights = self.model.layers.pop(i, None)
            if weights is None:
                continue
            if self.keep_host_copy:
                self._host_layers[i] = weights.to("cpu")
            released += self._release(f"layer{i}")
        self.graphs = None  # captured with the weights' addresses
        return released

    def restore_layers(self, start: int, end: int) -> None:
        """Load layers [start, end) back (host copy, else the checkpoint); charges the pool,
        which first reclaims free KV blocks — it refuses if live KV holds the bytes."""
        for i in range(start, end):
            if i not in self.layers:
                raise ValueError(f"layer {i} is outside this runner's range {self.layers}")
            if i not in self.model.layers:
                self._load_layer(i)
                self.graphs = None

    # --- attention routing ----------------------------------------------------------
    def set_attention(self, layer: int, attention: LayerAttention | None) -> None:
        """Run `layer`'s attention on `attention` (remote KV holder); None: back to local."""
        if attention is None:
            self._attention_override.pop(layer, None)
        else:
            self._attention_override[layer] = attention

    def _attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return self._attention_override.get(layer, self.attention)(layer, q, k, v)

    # --- one step ---------------------------------------------------------------------
    @torch.inference_mode()
    def execute(self, out: SchedulerOutput, hidden: torch.Tensor | None = None, *,
                layers: range | None = None) -> StepOutput:
        """`layers`: run only this resident sub-range (a buddy group's stage; default: every
        resident layer)."""
        chunks = out.chunks
        if not chunks:
            return StepOutput(None, None, [])
        if layers is None and self.use_graphs and self._replayable(chunks):
            return self._replay(chunks)
        layout = self.attention.prepare(chunks)
        q_lens = [len(c.token_ids) for c in chunks]
        stage = self.stage if layers is None else layers
        first = self.model.embed is not None and stage.start == 0
        last = self.model.lm_head is not None and stage.stop == self.cfg.num_layers
        if first:
            ids = [t for c in chunks for t in c.token_ids]
            hidden = self.model.embed_tokens(torch.tensor(ids, dtype=torch.long).to(self.device, non_blocking=True))
        elif hidden is None or hidden.shape[0] != layout.num_tokens:
            raise ValueError(f"stage {stage} needs hidden states for {layout.num_tokens} tokens")
        lora = step_hook(self.lora, self.cpu_lora, chunks, q_lens) if any(c.adapter for c in chunks) else None
        loading = self.loading
        if loading is not None:
            hidden = loading.run(stage.start, stage.stop, hidden, layout.positions, self._attend, lora)
        else:
            fused = self._decode_layers(stage, hidden, layout.positions) if lora is None else None
            hidden = fused if fused is not None else self.model.run_layers(
                stage.start, stage.stop, hidden, layout.positions, self._attend, lora)
        if not last:
            return StepOutput(None, hidden, [])
        rows, seq_ids, end = [], [], 0
        for c, n in zip(chunks, q_lens):
            end += n
            if c.sample:
                rows.append(end - 1)
                seq_ids.append(c.seq_id)
        if not rows:
            return StepOutput(None, None, [])
        last = hidden if len(rows) == hidden.shape[0] else hidden[torch.tensor(rows).to(self.device, non_blocking=True)]
        return StepOutput(self.model.compute_logits(last).float(), None, seq_ids)

    def _decode_layers(self, stage: range, hidden: torch.Tensor, positions: torch.Tensor) -> torch.Tensor | None:
        """The stage in one C++ call (LlamaModel.decode_layers) where every layer's attention is ours
        and the step decodes on the fp32 CPU kernel; None: run the layers one by one."""
        if self.model.cpu_ops is None or any(i in self._attention_override for i in stage):
            return None
        kv = self.attention.decode_kv(stage)
        return self.model.decode_layers(stage.start, stage.stop, hidden, positions, kv) if kv is not None else None

    def _replayable(self, chunks: list) -> bool:
        """A plain decode of the whole model with every layer's KV here (cuda_graphs.py)."""
        n = self.cfg.num_layers
        if self._attention_override or self.loading is not None or len(self.model.layers) != n:
            return False
        if self.model.embed is None or self.model.lm_head is None or list(self.kv_layers) != list(range(n)):
            return False
        if self.graphs is None:
            self.graphs = DecodeGraphs(self.model, self.kv_cache, self.kv_layers, self.cfg.sliding_window,
                                       self.cfg.max_position)
        return self.graphs.fits(chunks)

    def _replay(self, chunks: list) -> StepOutput:
        assert self.graphs is not None
        return StepOutput(self.graphs.run(chunks), None, [c.seq_id for c in chunks])

    # --- KV export / import (the data plane moves the tensors) -------------------------
    def export_kv(self, block_tables: dict[int, list[int]], num_tokens: int) -> dict[int, torch.Tensor]:
        """One request's KV for the given layers → layer: [2, num_tokens, kv_heads, d] (host)."""
        return {layer: self.kv_cache.export_tokens(t, num_tokens).cpu() for layer, t in block_tables.items()}

    def import_kv(self, block_tables: dict[int, list[int]], data: dict[int, torch.Tensor]) -> None:
        missing = set(block_tables) - set(data)
        if missing:
            raise ValueError(f"KV import lacks layers {sorted(missing)}")
        for layer, table in block_tables.items():
            self.kv_cache.import_tokens(table, data[layer])

    def close(self) -> None:
        """Release every charge this runner holds (weights and LoRA)."""
        for owner in list(self._charges):
            self._release(owner)
        self.lora.clear()
