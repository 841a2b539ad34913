"""Read a Llama-family safetensors checkpoint from a local directory, layer by layer.

Single-file (`model.safetensors`) and sharded (`model.safetensors.index.json` + shards)
layouts are both read lazily through `safe_open`, so a worker that serves layers [a, b)
reads only those tensors, and can read them again later (restore after a drop). Every
tensor is checked against the config's shape before use.

Nothing is opened until a tensor is asked for (the shard map is built on first use), and every
`safe_open` is counted (`CHECKPOINT_OPENS`): a model started from prewarmed weights held in the
pool reads no checkpoint, and the gpu_worker's tests and metrics can tell.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from .model_config import CheckpointError, ModelConfig

INDEX_FILE = "model.safetensors.index.json"
CHECKPOINT_OPENS = [0]  # safetensors files opened by any reader of this process (a list: mutable, thread-safe enough)


def _open(path: Path) -> Any:
    CHECKPOINT_OPENS[0] += 1
    return safe_open(str(path), framework="pt")
LAYER_PREFIX = "model.layers."


def layer_tensor_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """HF names (within `model.layers.{i}.`) and shapes of one decoder layer."""
    h, q, kv, inter = cfg.hidden_size, cfg.q_size, cfg.kv_size, cfg.intermediate_size
    shapes: dict[str, tuple[int, ...]] = {
        "input_layernorm.weight": (h,),
        "self_attn.q_proj.weight": (q, h),
        "self_attn.k_proj.weight": (kv, h),
        "self_attn.v_proj.weight": (kv, h),
        "self_attn.o_proj.weight": (h, q),
        "post_attention_layernorm.weight": (h,),
        "mlp.gate_proj.weight": (inter, h),
        "mlp.up_proj.weight": (inter, h),
        "mlp.down_proj.weight": (h, inter),
    }
    if cfg.qkv_bias:
        shapes |= {"self_attn.q_proj.bias": (q,), "self_attn.k_proj.bias": (kv,), "self_attn.v_proj.bias": (kv,)}
    return shapes


class CheckpointReader:
    """Maps tensor names to shard files and reads tensors on demand, validated."""

    def __init__(self, model_dir: str | Path, config: ModelConfig) -> None:
        self.model_dir = Path(model_dir)
        self.config = config
        self._map: dict[str, Path] | None = None  # built on first use: a prewarmed start opens nothing
        self._handles: dict[Path, Any] = {}

    @property
    def _weight_map(self) -> dict[str, Path]:
        if self._map is None:
            self._map = self._build_weight_map()
        return self._map

    def _build_weight_map(self) -> dict[str, Path]:
        index = self.model_dir / INDEX_FILE
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (json.JSONDecodeError, KeyError) as exc:
                raise CheckpointError(f"{index}: not a safetensors index ({exc})") from exc
            files = {name: self.model_dir / fname for name, fname in weight_map.items()}
            for path in set(files.values()):
                if not path.is_file():
                    raise CheckpointError(f"missing file: {path} (listed in {index.name})")
            return files
        shards = sorted(self.model_dir.glob("*.safetensors"))
        if not shards:
            raise CheckpointError(f"missing file: no *.safetensors in {self.model_dir}")
        files = {}
        for path in shards:
            with _open(path) as handle:
                files |= {name: path for name in handle.keys()}
        return files

    def has(self, name: str) -> bool:
        return name in self._weight_map

    def _handle(self, path: Path) -> Any:
        if path not in self._handles:
            self._handles[path] = _open(path)
        return self._handles[path]

    def read(self, name: str, shape: tuple[int, ...], dtype: torch.dtype | None = None) -> torch.Tensor:
        """One tensor by its HF name, shape-checked, converted to `dtype` (default: config's)."""
        path = self._weight_map.get(name)
        if path is None:
            raise CheckpointError(f"{self.model_dir}: tensor {name!r} is missing from the checkpoint")
        tensor = self._handle(path).get_tensor(name)
        if tuple(tensor.shape) != tuple(shape):
            raise CheckpointError(
                f"{path.name}: shape mismatch for {name!r}: checkpoint has {tuple(tensor.shape)}, "
                f"config.json implies {tuple(shape)}"
            )
        return tensor.to(dtype or self.config.dtype)

    def read_layer(self, index: int) -> dict[str, torch.Tensor]:
        """All tensors of decoder layer `index`, keyed by their name within the layer."""
        if not 0 <= index < self.config.num_layers:
            raise CheckpointError(f"layer {index} out of range (model has {self.config.num_layers})")
        prefix = f"{LAYER_PREFIX}{index}."
        return {key: self.read(prefix + key, shape) for key, shape in layer_tensor_shapes(self.config).items()}

    def read_embedding(self) -> torch.Tensor:
        cfg = self.config
        return self.read("model.embed_tokens.weight", (cfg.vocab_size, cfg.hidden_size))

    def read_final_norm(self) -> torch.Tensor:
        return self.read("model.norm.weight", (self.config.hidden_size,))

    def read_lm_head(self) -> torch.Tensor:
        cfg = self.config
        if cfg.tie_word_embeddings or not self.has("lm_head.weight"):
            if not cfg.tie_word_embeddings:
                raise CheckpointError(
                    f"{self.model_dir}: tensor 'lm_head.weight' is missing and tie_word_embeddings is false"
                )
            return self.read_embedding()
        return self.read("lm_head.weight", (cfg.vocab_size, cfg.hidden_size))

    def close(self) -> None:
        self._handles.clear()
