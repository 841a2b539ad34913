"""One LoRA adapter in PEFT format, read from its directory and validated: `load_adapter`.

An adapter directory holds `adapter_config.json` (r, lora_alpha, target_modules, ...) and
`adapter_model.safetensors` with keys like
`base_model.model.model.layers.3.self_attn.q_proj.lora_A.weight` ([r, in]) and
`...lora_B.weight` ([out, r]). Supported targets: q/k/v/o_proj and gate/up/down_proj.
The scaling (lora_alpha / r, or / sqrt(r) with use_rslora) is folded into B at load.
"""
from __future__ import annotations

import json
import math
import re
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file

from .model_config import CheckpointError, ModelConfig

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
_KEY = re.compile(r"layers\.(\d+)\.(?:self_attn|mlp)\.(\w+_proj)\.lora_([AB])(?:\.[\w-]+)?\.weight$")


def target_shape(cfg: ModelConfig, target: str) -> tuple[int, int]:
    """(in_features, out_features) of a target projection."""
    h, q, kv, i = cfg.hidden_size, cfg.q_size, cfg.kv_size, cfg.intermediate_size
    return {
        "q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h),
        "gate_proj": (h, i), "up_proj": (h, i), "down_proj": (i, h),
    }[target]


@dataclass(slots=True)
class LoRAAdapter:
    """One adapter's weights for the layers this engine holds: (layer, target) -> (A, B*scale)."""

    name: str
    rank: int
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]

    @property
    def nbytes(self) -> int:
        return sum(a.numel() * a.element_size() + b.numel() * b.element_size() for a, b in self.weights.values())

    def to(self, device: torch.device, non_blocking: bool = False) -> LoRAAdapter:
        """A copy on `device` (`non_blocking`: asynchronous from page-locked host memory on CUDA)."""
        moved = {key: (a.to(device, non_blocking=non_blocking), b.to(device, non_blocking=non_blocking))
                 for key, (a, b) in self.weights.items()}
        return LoRAAdapter(self.name, self.rank, moved)


def _refuse_unsupported(raw: dict[str, Any], path: Path) -> None:
    if raw.get("peft_type", "LORA") != "LORA":
        raise CheckpointError(f"{path}: peft_type {raw.get('peft_type')!r} is not LORA")
    for key in ("rank_pattern", "alpha_pattern"):
        if raw.get(key):
            raise CheckpointError(f"{path}: {key} is not supported")
    if raw.get("use_dora"):
        raise CheckpointError(f"{path}: use_dora is not supported")
    if raw.get("bias", "none") != "none":
        raise CheckpointError(f"{path}: bias={raw.get('bias')!r} is not supported (only 'none')")
    if raw.get("fan_in_fan_out"):
        raise CheckpointError(f"{path}: fan_in_fan_out is not supported")
    if raw.get("modules_to_save"):
        raise CheckpointError(f"{path}: modules_to_save is not supported")


def load_adapter(path: str | Path, name: str, cfg: ModelConfig, layers: Iterable[int]) -> LoRAAdapter:
    """Read and validate a PEFT adapter; keep only `layers`, in the model's dtype."""
    path = Path(path)
    config_path, weights_path = path / "adapter_config.json", path / "adapter_model.safetensors"
    for p in (config_path, weights_path):
        if not p.is_file():
            raise CheckpointError(f"missing file: {p}")
    raw = json.loads(config_path.read_text())
    _refuse_unsupported(raw, config_path)
    rank, alpha = int(raw["r"]), float(raw.get("lora_alpha", raw["r"]))
    scale = alpha / math.sqrt(rank) if raw.get("use_rslora") else alpha / rank
    keep = set(layers)
    pairs: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for key, tensor in load_file(str(weights_path)).items():
        m = _KEY.search(key)
        if m is None or m.group(2) not in TARGETS:
            raise CheckpointError(f"{weights_path.name}: unsupported adapter tensor {key!r}")
        layer, target, which = int(m.group(1)), m.group(2), m.group(3)
        if not 0 <= layer < cfg.num_layers:
            raise CheckpointError(f"{weights_path.name}: {key!r} names layer {layer}, model has {cfg.num_layers}")
        if layer in keep:
            pairs.setdefault((layer, target), {})[which] = tensor
    weights = {}
    for (layer, target), ab in pairs.items():
        if set(ab) != {"A", "B"}:
            raise CheckpointError(f"{weights_path.name}: layer {layer} {target} lacks lora_{'AB'[int('A' in ab)]}")
        fan_in, fan_out = target_shape(cfg, target)
        a, b = ab["A"], ab["B"]
        if tuple(a.shape) != (rank, fan_in) or tuple(b.shape) != (fan_out, rank):
            raise CheckpointError(
                f"{weights_path.name}: shape mismatch at layer {layer} {target}: A {tuple(a.shape)}, "
                f"B {tuple(b.shape)}; expected A {(rank, fan_in)}, B {(fan_out, rank)} for r={rank}"
            )
        weights[(layer, target)] = (a.to(cfg.dtype).contiguous(), (b.float() * scale).to(cfg.dtype).contiguous())
    return LoRAAdapter(name=name, rank=rank, weights=weights)
