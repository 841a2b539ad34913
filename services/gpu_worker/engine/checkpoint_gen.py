"""Small random-weight checkpoints and LoRA adapters in the exact Hugging Face / PEFT layout.

Tests, the demo and benchmarks run on these where no real model is downloaded. The
weights are scaled so generation is not degenerate: projections keep unit activations
(std 1/sqrt(fan_in)), norms are near one, and the head gives logits with std ≈ 2.5 so
greedy outputs depend on the prompt. Adapters get a random, NONZERO B so they change
outputs (PEFT would initialise B to zero).
"""
from __future__ import annotations

import json
import math
from pathlib import Path

import torch
from safetensors.torch import save_file

from .loader import INDEX_FILE, layer_tensor_shapes
from .model_config import load_model_config, parse_dtype
from .tokenizer import save_tokenizer, train_tokenizer

ARCHS = {"llama": ("LlamaForCausalLM", "llama"), "qwen2": ("Qwen2ForCausalLM", "qwen2"),
         "mistral": ("MistralForCausalLM", "mistral")}
LORA_TARGETS = {"q": "q_proj", "k": "k_proj", "v": "v_proj", "o": "o_proj",
                "gate": "gate_proj", "up": "up_proj", "down": "down_proj"}


def _config_json(arch: str, *, layers: int, hidden: int, heads: int, kv_heads: int, intermediate: int,
                 vocab: int, dtype: str, max_position: int, tie: bool, special: dict,
                 rope_theta: float, rope_scaling: dict | None, sliding_window: int | None) -> dict:
    architecture, model_type = ARCHS[arch]
    cfg = {
        "architectures": [architecture], "model_type": model_type, "hidden_act": "silu",
        "hidden_size": hidden, "intermediate_size": intermediate, "num_hidden_layers": layers,
        "num_attention_heads": heads, "num_key_value_heads": kv_heads, "head_dim": hidden // heads,
        "vocab_size": vocab, "max_position_embeddings": max_position, "rms_norm_eps": 1e-5,
        "rope_theta": rope_theta, "rope_scaling": rope_scaling, "tie_word_embeddings": tie,
        "initializer_range": 0.02, "attention_dropout": 0.0, "use_cache": True, "torch_dtype": dtype,
        "bos_token_id": special["bos_token_id"], "eos_token_id": special["eos_token_id"][0],
    }
    if arch == "llama":
        cfg |= {"attention_bias": False, "mlp_bias": False, "pretraining_tp": 1}
    elif arch == "qwen2":
        cfg |= {"use_sliding_window": False, "sliding_window": None, "max_window_layers": layers}
    else:
        cfg |= {"sliding_window": sliding_window}
    return cfg


def _random_weights(cfg, gen: torch.Generator, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    def normal(shape: tuple[int, ...], std: float, mean: float = 0.0) -> torch.Tensor:
        return (torch.randn(shape, generator=gen) * std + mean).to(dtype)

    h, v = cfg.hidden_size, cfg.vocab_size
    out = {"model.embed_tokens.weight": normal((v, h), 1.0)}
    for i in range(cfg.num_layers):
        for name, shape in layer_tensor_shapes(cfg).items():
            if name.endswith("norm.weight"):
                t = normal(shape, 0.1, 1.0)
            elif name.endswith(".bias"):
                t = normal(shape, 0.1)
            else:
                t = normal(shape, 1.0 / math.sqrt(shape[1]))
            out[f"model.layers.{i}.{name}"] = t
    out["model.norm.weight"] = normal((h,), 0.1, 1.0)
    if not cfg.tie_word_embeddings:
        out["lm_head.weight"] = normal((v, h), 2.5 / math.sqrt(h))
    else:  # tied: the embedding is the head; scale it for logits std ≈ 2.5 (norms undo it inside)
        out["model.embed_tokens.weight"] = normal((v, h), 2.5 / math.sqrt(h))
    return out


def _save_sharded(tensors: dict[str, torch.Tensor], out: Path, shard_size: int | None) -> None:
    meta = {"format": "pt"}
    if not shard_size:
        save_file(tensors, str(out / "model.safetensors"), metadata=meta)
        return
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, t in tensors.items():
        nbytes = t.numel() * t.element_size()
        if shards[-1] and size + nbytes > shard_size:
            shards.append({})
            size = 0
        shards[-1][name] = t
        size += nbytes
    weight_map = {}
    for k, shard in enumerate(shards, 1):
        fname = f"model-{k:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(out / fname), metadata=meta)
        weight_map |= {name: fname for name in shard}
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    (out / INDEX_FILE).write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))


def write_config(out_dir: str | Path, *, arch: str = "llama", layers: int, hidden: int, heads: int, kv_heads: int,
                 intermediate: int, vocab: int, dtype: str = "bfloat16", max_position: int = 8192,
                 tie_embeddings: bool = False, rope_theta: float = 500000.0) -> Path:
    """config.json alone, no weights and no tokenizer: for a runner handed its weights already in
    device memory (`PreloadedWeights`), as the CUDA engine bench generates them on the device."""
    if arch not in ARCHS:
        raise ValueError(f"unknown arch {arch!r}; choose from {sorted(ARCHS)}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    config = _config_json(arch, layers=layers, hidden=hidden, heads=heads, kv_heads=kv_heads,
                          intermediate=intermediate, vocab=vocab, dtype=dtype, max_position=max_position,
                          tie=tie_embeddings, special={"bos_token_id": 1, "eos_token_id": [2]},
                          rope_theta=rope_theta, rope_scaling=None, sliding_window=None)
    (out / "config.json").write_text(json.dumps(config, indent=2))
    return out


def make_model(out_dir: str | Path, *, arch: str = "llama", layers: int = 2, hidden: int = 64, heads: int = 4,
               kv_heads: int = 2, intermediate: int | None = None, vocab: int = 1024, seed: int = 0,
               dtype: str = "float32", max_position: int = 2048, tie_embeddings: bool | None = None,
               shard_size: int | None = None, rope_theta: float = 10000.0, rope_scaling: dict | None = None,
               sliding_window: int | None = None) -> Path:
    """Write config.json, safetensors, generation_config.json and a trained tokenizer."""
    if arch not in ARCHS:
        raise ValueError(f"unknown arch {arch!r}; choose from {sorted(ARCHS)}")
    if hidden % heads or heads % kv_heads or (hidden // heads) % 2:
        raise ValueError(f"need hidden % heads == 0, heads % kv_heads == 0, even head_dim ({hidden}, {heads}, {kv_heads})")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    chat_format = "llama3" if arch == "llama" else "chatml"
    special = save_tokenizer(train_tokenizer(vocab, chat_format=chat_format), out,
                             chat_format=chat_format, model_max_length=max_position)
    tie = (arch == "qwen2") if tie_embeddings is None else tie_embeddings
    intermediate = intermediate or 4 * hidden
    config = _config_json(arch, layers=layers, hidden=hidden, heads=heads, kv_heads=kv_heads,
                          intermediate=intermediate, vocab=vocab, dtype=dtype, max_position=max_position,
                          tie=tie, special=special, rope_theta=rope_theta, rope_scaling=rope_scaling,
                          sliding_window=sliding_window)
    (out / "config.json").write_text(json.dumps(config, indent=2))
    generation = {"bos_token_id": special["bos_token_id"], "eos_token_id": special["eos_token_id"],
                  "pad_token_id": special["pad_token_id"], "do_sample": False}
    (out / "generation_config.json").write_text(json.dumps(generation, indent=2))
    cfg = load_model_config(out)
    gen = torch.Generator().manual_seed(seed)
    _save_sharded(_random_weights(cfg, gen, parse_dtype(dtype)), out, shard_size)
    return out


def make_lora(out_dir: str | Path, base: str | Path, *, rank: int = 8, targets: list[str] | None = None,
              alpha: float | None = None, seed: int = 0) -> Path:
    """Write a PEFT LoRA adapter (adapter_config.json + adapter_model.safetensors) for `base`."""
    cfg = load_model_config(base)
    names = [LORA_TARGETS.get(t, t) for t in (targets or ["q", "k", "v", "o"])]
    bad = [n for n in names if n not in LORA_TARGETS.values()]
    if bad or rank < 1:
        raise ValueError(f"bad targets {bad} or rank {rank}; targets are {sorted(LORA_TARGETS)}")
    alpha = float(alpha if alpha is not None else 2 * rank)
    scale = alpha / rank
    gen = torch.Generator().manual_seed(seed)
    shapes = {n: (s[1], s[0]) for n, s in _target_shapes(cfg).items()}  # (in, out)
    tensors = {}
    for i in range(cfg.num_layers):
        for name in names:
            fan_in, fan_out = shapes[name]
            prefix = f"base_model.model.model.layers.{i}.{'mlp' if name in ('gate_proj', 'up_proj', 'down_proj') else 'self_attn'}.{name}"
            bound = 1.0 / math.sqrt(fan_in)  # PEFT's kaiming-uniform bound for A
            tensors[f"{prefix}.lora_A.weight"] = (torch.rand((rank, fan_in), generator=gen) * 2 - 1) * bound
            # B: nonzero, sized so the delta is ≈ 0.5 of a unit activation
            std = 0.5 / (scale * 0.58 * math.sqrt(rank))
            tensors[f"{prefix}.lora_B.weight"] = torch.randn((fan_out, rank), generator=gen) * std
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    dtype = cfg.dtype
    save_file({k: v.to(dtype).contiguous() for k, v in tensors.items()}, str(out / "adapter_model.safetensors"),
              metadata={"format": "pt"})
    config = {
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": str(base),
        "r": rank, "lora_alpha": alpha, "lora_dropout": 0.0, "target_modules": names, "bias": "none",
        "fan_in_fan_out": False, "use_rslora": False, "use_dora": False, "inference_mode": True,
        "init_lora_weights": True, "modules_to_save": None, "rank_pattern": {}, "alpha_pattern": {},
        "layers_to_transform": None, "layers_pattern": None,
    }
    (out / "adapter_config.json").write_text(json.dumps(config, indent=2))
    return out


def _target_shapes(cfg) -> dict[str, tuple[int, int]]:
    """target -> (out, in), the nn.Linear weight shape."""
    shapes = layer_tensor_shapes(cfg)
    return {n: shapes[f"{'mlp' if n in ('gate_proj', 'up_proj', 'down_proj') else 'self_attn'}.{n}.weight"]
            for n in LORA_TARGETS.values()}
