"""Typed model configuration parsed from a Hugging Face checkpoint directory.

Reads `config.json` (+ `generation_config.json` when present) of the Llama family:
LlamaForCausalLM (Llama 2/3, rope_scaling "llama3" or "linear"), Qwen2ForCausalLM (QKV
bias) and MistralForCausalLM (sliding window). Qwen2 and Mistral are config properties of
the same model code, not separate implementations.

Sliding window (decision): honoured. The attention masks keys more than `sliding_window`
positions behind the query (transformers' rule: kv_pos > q_pos - window); KV blocks
outside the window are kept (not freed), so memory is the same as full attention.
Qwen2's per-layer window (`use_sliding_window: true`) is refused: no released Qwen2
checkpoint enables it and honouring it needs per-layer masks.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "Qwen2ForCausalLM", "MistralForCausalLM")
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class CheckpointError(ValueError):
    """A checkpoint or adapter directory that cannot be used; the message names why."""


@dataclass(frozen=True, slots=True)
class RopeConfig:
    theta: float = 10000.0
    kind: str = "default"  # "default" | "llama3" | "linear"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position: int = 8192

    def inv_freq(self, head_dim: int) -> torch.Tensor:
        """Inverse frequencies (float32, head_dim/2), as transformers computes them."""
        exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).to(torch.float32) / head_dim
        inv = 1.0 / (self.theta**exponents)
        if self.kind == "linear":
            return inv / self.factor
        if self.kind != "llama3":
            return inv
        low_wavelen = self.original_max_position / self.low_freq_factor
        high_wavelen = self.original_max_position / self.high_freq_factor
        wavelen = 2 * math.pi / inv
        scaled = torch.where(wavelen > low_wavelen, inv / self.factor, inv)
        smooth = (self.original_max_position / wavelen - self.low_freq_factor) / (
            self.high_freq_factor - self.low_freq_factor
        )
        smoothed = (1 - smooth) * scaled / self.factor + smooth * scaled
        is_medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
        return torch.where(is_medium, smoothed, scaled)


@dataclass(frozen=True, slots=True)
class GenerationDefaults:
    """`generation_config.json`: what a request gets when it names nothing."""

    eos_token_ids: tuple[int, ...] = ()
    bos_token_id: int | None = None
    pad_token_id: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    max_new_tokens: int | None = None


@dataclass(frozen=True, slots=True)
class ModelConfig:
    architecture: str
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position: int
    rope: RopeConfig
    qkv_bias: bool
    tie_word_embeddings: bool
    dtype: torch.dtype
    sliding_window: int | None = None
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    generation: GenerationDefaults = field(default_factory=GenerationDefaults)
    name: str = ""

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    def with_dtype(self, dtype: torch.dtype) -> ModelConfig:
        from dataclasses import replace

        return replace(self, dtype=dtype)


def parse_dtype(name: str | torch.dtype) -> torch.dtype:
    if isinstance(name, torch.dtype):
        if name not in _DTYPES.values():
            raise CheckpointError(f"unsupported dtype {name}; use one of {sorted(_DTYPES)}")
        return name
    key = name.removeprefix("torch.")
    if key not in _DTYPES:
        raise CheckpointError(f"unsupported dtype {name!r}; use one of {sorted(_DTYPES)}")
    return _DTYPES[key]


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        raise CheckpointError(f"missing file: {path}")
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise CheckpointError(f"{path} is not valid JSON: {exc}") from exc
    if not isinstance(data, dict):
        raise CheckpointError(f"{path} must hold a JSON object")
    return data


def _token_ids(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, int):
        return (value,)
    return tuple(int(v) for v in value)


def _rope(raw: dict[str, Any], max_position: int, path: Path) -> RopeConfig:
    # transformers 5 writes `rope_parameters` (theta inside); older checkpoints write
    # `rope_theta` + `rope_scaling` at the top level. Accept both.
    params = dict(raw.get("rope_parameters") or raw.get("rope_scaling") or {})
    theta = float(params.get("rope_theta", raw.get("rope_theta", 10000.0)))
    kind = params.get("rope_type", params.get("type", "default")) or "default"
    if kind == "default":
        return RopeConfig(theta=theta)
    if kind == "linear":
        return RopeConfig(theta=theta, kind="linear", factor=float(params["factor"]))
    if kind == "llama3":
        try:
            return RopeConfig(
                theta=theta,
                kind="llama3",
                factor=float(params["factor"]),
                low_freq_factor=float(params["low_freq_factor"]),
                high_freq_factor=float(params["high_freq_factor"]),
                original_max_position=int(params.get("original_max_position_embeddings", max_position)),
            )
        except KeyError as exc:
            raise CheckpointError(f"{path}: rope_scaling type llama3 lacks {exc.args[0]!r}") from exc
    raise CheckpointError(f"{path}: unsupported rope_scaling type {kind!r} (supported: default, linear, llama3)")


def _generation(model_dir: Path) -> GenerationDefaults:
    path = model_dir / "generation_config.json"
    if not path.is_file():
        return GenerationDefaults()
    raw = _read_json(path)
    return GenerationDefaults(
        eos_token_ids=_token_ids(raw.get("eos_token_id")),
        bos_token_id=raw.get("bos_token_id"),
        pad_token_id=raw.get("pad_token_id"),
        temperature=raw.get("temperature"),
        top_p=raw.get("top_p"),
        top_k=raw.get("top_k"),
        max_new_tokens=raw.get("max_new_tokens"),
    )


def load_model_config(model_dir: str | Path, dtype: str | torch.dtype | None = None) -> ModelConfig:
    """Parse `model_dir/config.json`; `dtype` overrides the checkpoint's dtype."""
    model_dir = Path(model_dir)
    path = model_dir / "config.json"
    raw = _read_json(path)
    archs = raw.get("architectures") or []
    arch = next((a for a in archs if a in SUPPORTED_ARCHITECTURES), None)
    if arch is None:
        raise CheckpointError(
            f"{path}: unknown architecture {archs or '(none given)'}; supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    try:
        hidden = int(raw["hidden_size"])
        heads = int(raw["num_attention_heads"])
        cfg_vocab = int(raw["vocab_size"])
        inter = int(raw["intermediate_size"])
        layers = int(raw["num_hidden_layers"])
    except KeyError as exc:
        raise CheckpointError(f"{path}: missing field {exc.args[0]!r}") from exc
    kv_heads = int(raw.get("num_key_value_heads") or heads)
    head_dim = int(raw.get("head_dim") or hidden // heads)
    if heads % kv_heads:
        raise CheckpointError(f"{path}: num_attention_heads {heads} is not a multiple of num_key_value_heads {kv_heads}")
    if raw.get("hidden_act", "silu") != "silu":
        raise CheckpointError(f"{path}: unsupported hidden_act {raw.get('hidden_act')!r} (only silu)")
    if raw.get("mlp_bias"):
        raise CheckpointError(f"{path}: mlp_bias is not supported")
    max_position = int(raw.get("max_position_embeddings", 4096))
    window = None
    if arch == "MistralForCausalLM" and raw.get("sliding_window") is not None:
        window = int(raw["sliding_window"])
        window = window if window < max_position else None  # a window ≥ context is full attention
    if arch == "Qwen2ForCausalLM" and raw.get("use_sliding_window"):
        raise CheckpointError(f"{path}: Qwen2 use_sliding_window=true is not supported")
    qkv_bias = arch == "Qwen2ForCausalLM" or bool(raw.get("attention_bias", False))
    dtype_name = raw.get("dtype") or raw.get("torch_dtype") or "float32"
    generation = _generation(model_dir)
    eos = _token_ids(raw.get("eos_token_id")) or generation.eos_token_ids
    return ModelConfig(
        architecture=arch,
        model_type=str(raw.get("model_type", "")),
        vocab_size=cfg_vocab,
        hidden_size=hidden,
        intermediate_size=inter,
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
        max_position=max_position,
        rope=_rope(raw, max_position, path),
        qkv_bias=qkv_bias,
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        dtype=parse_dtype(dtype if dtype is not None else dtype_name),
        sliding_window=window,
        bos_token_id=raw.get("bos_token_id"),
        eos_token_ids=eos,
        generation=generation,
        name=model_dir.name,
    )
