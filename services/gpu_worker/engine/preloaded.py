"""Weights already in device memory, handed to a new `ModelRunner` instead of the checkpoint.

`PreloadedWeights` is what a worker keeps of a model between instances (WarmServe's prewarmed
slot): the fused, packed tensors of some layers — and the embedding, final norm and LM head when
it has them — exactly as a runner holds them, so starting an instance on them copies nothing and
reads no checkpoint (`ModelRunner(preloaded=...)`). They come from a runner being retired
(`from_runner`: an evicted instance keeps its weights through the grace period) or from the
checkpoint ahead of demand (`read`: the first layers of a model, prewarmed).

`LayerLoader` is the other half: a runner that starts with only its first layers resident loads
the rest on a background thread while it serves; a step runs each layer as soon as that layer is
resident, so the first prefills overlap the loading (WarmServe §4: "perform parallel model
loading and inference").
"""
from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import torch

from gpu_ext.linear import pack_weight, weight_nbytes

from .loader import CheckpointReader
from .model_config import ModelConfig
from .models.llama import LayerWeights, LlamaModel


class LayerHost(Protocol):
    """What preloading needs of a runner (model_runner.ModelRunner, which imports this module)."""

    model: LlamaModel
    reader: CheckpointReader
    loading: LayerLoader | None

    def _load_layer(self, i: int) -> None:
        """Read layer `i`, charge the pool, make it resident."""


@dataclass(slots=True)
class PreloadedWeights:
    model_dir: str
    layers: dict[int, LayerWeights] = field(default_factory=dict)
    embed: torch.Tensor | None = None
    final_norm: torch.Tensor | None = None
    lm_head: Any = None  # packed like the runner packs it (may be `embed` itself when tied)

    def parts(self) -> dict[str, int]:
        """Owner suffix (`layer3`, `embed`, `lm_head`) -> device bytes, as a runner charges them."""
        out = {f"layer{i}": w.nbytes for i, w in sorted(self.layers.items())}
        if self.embed is not None:
            out["embed"] = self.embed.numel() * self.embed.element_size()
        if self.final_norm is not None and self.lm_head is not None:
            extra = 0 if self.lm_head is self.embed else weight_nbytes(self.lm_head)
            out["lm_head"] = self.final_norm.numel() * self.final_norm.element_size() + extra
        return out

    @property
    def nbytes(self) -> int:
        return sum(self.parts().values())

    @property
    def first_layers(self) -> int:
        """How many layers from layer 0 on are held (a runner can start computing with these)."""
        n = 0
        while n in self.layers:
            n += 1
        return n

    def covers(self, num_layers: int) -> bool:
        """Everything a whole-model runner needs: no checkpoint read at all."""
        return (self.embed is not None and self.lm_head is not None and self.final_norm is not None
                and all(i in self.layers for i in range(num_layers)))

    @classmethod
    def from_runner(cls, runner: LayerHost) -> PreloadedWeights:
        """Take a retired runner's resident weights (the runner must not step again)."""
        m = runner.model
        return cls(model_dir=str(runner.reader.model_dir), layers=dict(m.layers), embed=m.embed,
                   final_norm=m.final_norm, lm_head=m.lm_head)

    @classmethod
    def read(cls, model_dir: str | Path, cfg: ModelConfig, layers: range, device: str | torch.device,
             before_layer: Callable[[], None] | None = None) -> PreloadedWeights:
        """Read `layers` (and the stage ends they touch) from the checkpoint, as a runner would;
        `before_layer` is called before each layer is read (a prewarm yields to serving there)."""
        reader = CheckpointReader(model_dir, cfg)
        try:
            out = cls(model_dir=str(model_dir))
            for i in layers:
                if before_layer is not None:
                    before_layer()
                out.layers[i] = LayerWeights.from_hf(reader.read_layer(i), device)
            if layers.start == 0:
                out.embed = reader.read_embedding().to(device)
            if layers.stop == cfg.num_layers:
                out.final_norm = reader.read_final_norm().to(device)
                if cfg.tie_word_embeddings and out.embed is not None:
                    out.lm_head = pack_weight(out.embed)
                else:
                    out.lm_head = pack_weight(reader.read_lm_head().to(device))
            return out
        finally:
            reader.close()


def model_weight_bytes(cfg: ModelConfig) -> tuple[int, int]:
    """(all weights, one decoder layer) in bytes, from the config's shapes alone (no checkpoint)."""
    item = cfg.dtype.itemsize
    h, q, kv, inter = cfg.hidden_size, cfg.q_size, cfg.kv_size, cfg.intermediate_size
    layer = (2 * h + (q + 2 * kv) * h + h * q + 3 * inter * h + ((q + 2 * kv) if cfg.qkv_bias else 0)) * item
    embed = cfg.vocab_size * h * item
    head = (0 if cfg.tie_word_embeddings else embed) + h * item
    return layer * cfg.num_layers + embed + head, layer


class LayerLoader:
    """Loads a runner's missing layers in order on a thread of its own; `run` computes layers as
    they arrive. The runner's `loading` is cleared when the last layer is resident."""

    def __init__(self, runner: LayerHost, pending: list[int],
                 before_layer: Callable[[int], None] | None = None) -> None:
        self.runner = runner
        self.pending = list(pending)
        self.before_layer = before_layer  # tests: hold a layer back
        self.error: BaseException | None = None
        self._cond = threading.Condition()
        self._thread = threading.Thread(target=self._load, name="layer-loader", daemon=True)
        self._started = False

    def start(self) -> None:
        """Begin loading (its owner calls this once the engine is built; the first step that needs a
        missing layer starts it too)."""
        with self._cond:
            if self._started:
                return
            self._started = True
        self._thread.start()

    def join(self, timeout: float | None = None) -> None:
        if self._started:
            self._thread.join(timeout)

    def _load(self) -> None:
        try:
            for i in self.pending:
                if self.before_layer is not None:
                    self.before_layer(i)
                self.runner._load_layer(i)  # noqa: SLF001 - reads, charges the pool, makes it resident
                with self._cond:
                    self._cond.notify_all()
        except BaseException as exc:  # the engine thread raises it at the next layer it needs
            with self._cond:
                self.error = exc
                self._cond.notify_all()
            return
        with self._cond:
            self.runner.loading = None
            self._cond.notify_all()

    def wait_for(self, layer: int) -> None:
        with self._cond:
            while layer not in self.runner.model.layers:
                if self.error is not None:
                    raise RuntimeError(f"layer {layer} could not be loaded: {self.error!r}") from self.error
                self._cond.wait()

    def run(self, start: int, end: int, hidden: torch.Tensor, positions: torch.Tensor, attend: Any,
            lora: Any) -> torch.Tensor:
        """Layers [start, end), each once it is resident (the model's `run_layers` one layer at a time)."""
        self.start()
        for i in range(start, end):
            self.wait_for(i)
            hidden = self.runner.model.run_layers(i, i + 1, hidden, positions, attend, lora)
        return hidden


__all__ = ["LayerLoader", "PreloadedWeights", "model_weight_bytes"]
