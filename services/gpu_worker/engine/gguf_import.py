"""`import_gguf`: a llama.cpp GGUF file -> a Hugging Face checkpoint directory the engine serves.

Reads the file with the `gguf` package (memory-mapped), dequantizes every tensor with
`gguf.quants.dequantize` (F32/F16/BF16, Q4_0/Q4_1/Q5_x/Q8_0, the K-quants, ... whatever the
installed version implements), and writes config.json (LlamaForCausalLM), model.safetensors,
tokenizer.json + tokenizer_config.json (rebuilt from the metadata, `gguf_tokenizer`),
chat_template.jinja (from `tokenizer.chat_template`) and generation_config.json.

llama.cpp's converter permutes the rows of Llama's Q and K projections (its rotary embedding
pairs adjacent dimensions, Hugging Face's pairs the two halves); the import undoes that.
Only the `llama` architecture is converted (Llama 2/3, Mistral, SmolLM, ... without MoE or
Llama 3.1-style rope frequency factors); anything else is refused with a message naming it.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

from .gguf_tokenizer import GGUFTokenizerError, build_tokenizer

SUPPORTED_ARCHITECTURES = ("llama",)
_LAYER_TENSORS = {
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_TOP_TENSORS = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
                "output.weight": "lm_head.weight"}


class GGUFImportError(ValueError):
    """The file cannot be imported; the message names the file and what is wrong."""


def open_gguf(path: str | Path) -> Any:
    """A `gguf.GGUFReader` on `path`; a missing, non-GGUF, truncated or corrupt file is refused."""
    import gguf

    path = Path(path)
    try:
        with open(path, "rb") as f:
            magic = f.read(4)
    except OSError as exc:
        raise GGUFImportError(f"{path}: cannot read: {exc.strerror or exc}") from None
    if magic != b"GGUF":
        raise GGUFImportError(f"{path}: not a GGUF file (it starts with {magic!r}, a GGUF with b'GGUF')")
    try:
        return gguf.GGUFReader(path)
    except (ValueError, IndexError, KeyError, OSError, OverflowError, UnicodeDecodeError) as exc:
        raise GGUFImportError(f"{path}: a truncated or corrupt GGUF file ({exc})") from None


def _field_value(field: Any) -> Any:
    import gguf

    kinds = field.types
    if not kinds:
        return None
    if kinds[0] == gguf.GGUFValueType.ARRAY:
        if len(kinds) > 1 and kinds[1] == gguf.GGUFValueType.STRING:
            return [bytes(field.parts[i]).decode("utf-8", errors="replace") for i in field.data]
        return [field.parts[i][0].item() for i in field.data]
    if kinds[0] == gguf.GGUFValueType.STRING:
        return bytes(field.parts[field.data[0]]).decode("utf-8", errors="replace")
    value = field.parts[field.data[0]][0]
    if kinds[0] == gguf.GGUFValueType.FLOAT32:
        return float(str(np.float32(value)))  # 1e-05, not 9.999999747378752e-06
    return value.item()


def read_metadata(reader: Any) -> dict[str, Any]:
    return {name: _field_value(field) for name, field in reader.fields.items()}


def _int(meta: dict[str, Any], key: str, default: int | None = None) -> int:
    value = meta.get(key, default)
    if not isinstance(value, int) or isinstance(value, bool):
        raise GGUFImportError(f"metadata {key} must be one integer, got {value!r}")
    return value


def config_json(meta: dict[str, Any], tensor_names: set[str], vocab: int, dtype: str) -> dict[str, Any]:
    """LlamaForCausalLM's config.json from the `llama.*` metadata."""
    arch = meta.get("general.architecture")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise GGUFImportError(f"GGUF architecture {arch!r} is not supported: only {list(SUPPORTED_ARCHITECTURES)} "
                              "(Llama 2/3, Mistral, SmolLM and other LlamaForCausalLM checkpoints) is imported")
    if meta.get("llama.expert_count"):
        raise GGUFImportError("a mixture-of-experts llama GGUF (llama.expert_count) is not supported")
    if "rope_freqs.weight" in tensor_names:
        raise GGUFImportError("Llama 3.1-style rope frequency factors (tensor rope_freqs) are not supported")
    heads = _int(meta, "llama.attention.head_count")
    hidden = _int(meta, "llama.embedding_length")
    head_dim = _int(meta, "llama.attention.key_length", meta.get("llama.rope.dimension_count", hidden // heads))
    scaling = meta.get("llama.rope.scaling.type", "none")
    if scaling not in ("none", "linear"):
        raise GGUFImportError(f"llama.rope.scaling.type {scaling!r} is not supported (only 'none' or 'linear')")
    rope_scaling = ({"rope_type": "linear", "factor": float(meta.get("llama.rope.scaling.factor", 1.0))}
                    if scaling == "linear" else None)
    return {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_act": "silu",
        "hidden_size": hidden, "intermediate_size": _int(meta, "llama.feed_forward_length"),
        "num_hidden_layers": _int(meta, "llama.block_count"), "num_attention_heads": heads,
        "num_key_value_heads": _int(meta, "llama.attention.head_count_kv", heads), "head_dim": head_dim,
        "vocab_size": vocab, "max_position_embeddings": _int(meta, "llama.context_length", 2048),
        "rms_norm_eps": float(meta.get("llama.attention.layer_norm_rms_epsilon", 1e-5)),
        "rope_theta": float(meta.get("llama.rope.freq_base", 10000.0)), "rope_scaling": rope_scaling,
        "tie_word_embeddings": "output.weight" not in tensor_names,
        "attention_bias": False, "mlp_bias": False, "pretraining_tp": 1, "initializer_range": 0.02,
        "attention_dropout": 0.0, "use_cache": True, "torch_dtype": dtype,
    }


def hf_tensor_name(name: str) -> str:
    if name in _TOP_TENSORS:
        return _TOP_TENSORS[name]
    parts = name.split(".")
    if len(parts) == 4 and parts[0] == "blk" and parts[1].isdigit() and parts[2] in _LAYER_TENSORS \
            and parts[3] == "weight":
        return f"model.layers.{parts[1]}.{_LAYER_TENSORS[parts[2]]}.weight"
    raise GGUFImportError(f"tensor {name!r} is not one of a Llama checkpoint's tensors")


def unpermute_rotary(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's `permute` of a Q or K weight: per head, rows (half, 2) -> (2, half)."""
    rows = w.shape[0]
    return w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def check_tensors(reader: Any) -> None:
    """Every tensor is a Llama one of a type the installed gguf package dequantizes (before any work)."""
    from gguf import GGMLQuantizationType, quants

    traits = getattr(quants, "_type_traits", None)  # the types this gguf version implements
    simple = (GGMLQuantizationType.F32, GGMLQuantizationType.F16)
    bad = sorted({t.tensor_type.name for t in reader.tensors
                  if not (t.tensor_type in simple or traits is None or t.tensor_type in traits)})
    if bad:
        raise GGUFImportError(f"quantization type(s) {bad} cannot be dequantized by the installed gguf package "
                              f"(gguf {_gguf_version()})")
    for t in reader.tensors:
        hf_tensor_name(t.name)


def _gguf_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("gguf")
    except PackageNotFoundError:
        return "unknown version"


def _weights(reader: Any, config: dict[str, Any], dtype: str) -> dict[str, Any]:
    import torch
    from gguf import quants

    from .model_config import parse_dtype

    torch_dtype = parse_dtype(dtype)
    out = {}
    for t in reader.tensors:
        name = hf_tensor_name(t.name)
        try:
            w = quants.dequantize(t.data, t.tensor_type)
        except NotImplementedError:
            raise GGUFImportError(f"tensor {t.name}: quantization type {t.tensor_type.name} cannot be "
                                  "dequantized by the installed gguf package") from None
        w = w.reshape(tuple(int(d) for d in reversed(t.shape)))
        if t.name.endswith("attn_q.weight"):
            w = unpermute_rotary(w, config["num_attention_heads"])
        elif t.name.endswith("attn_k.weight"):
            w = unpermute_rotary(w, config["num_key_value_heads"])
        out[name] = torch.from_numpy(np.array(w, dtype=np.float32)).to(torch_dtype)
    return out


def import_gguf(path: str | Path, out_dir: str | Path, *, dtype: str = "float32") -> Path:
    """Write the Hugging Face checkpoint of the GGUF at `path` into `out_dir`; returns `out_dir`."""
    from safetensors.torch import save_file

    path, out = Path(path), Path(out_dir)
    reader = open_gguf(path)
    try:
        meta = read_metadata(reader)
        names = {t.name for t in reader.tensors}
        embed = next((t for t in reader.tensors if t.name == "token_embd.weight"), None)
        if embed is None:
            raise GGUFImportError("no token_embd.weight tensor")
        config = config_json(meta, names, int(embed.shape[-1]), dtype)
        check_tensors(reader)
        tok = build_tokenizer(meta, config["max_position_embeddings"])
        weights = _weights(reader, config, dtype)
    except (GGUFImportError, GGUFTokenizerError) as exc:
        raise GGUFImportError(f"{path}: {exc}") from None
    ids = tok.special_ids
    eos = [ids["eos"]] if "eos" in ids else []
    eot = meta.get("tokenizer.ggml.eot_token_id")
    if isinstance(eot, int) and eot not in eos and 0 <= eot < config["vocab_size"]:
        eos.append(eot)  # Llama 3: a turn ends with <|eot_id|>, the text with <|end_of_text|>
    config |= {"bos_token_id": ids.get("bos"), "eos_token_id": eos[0] if eos else None}
    generation = {"bos_token_id": ids.get("bos"), "eos_token_id": eos if len(eos) > 1 else (eos[0] if eos else None),
                  "pad_token_id": ids.get("pad")}

    out.mkdir(parents=True, exist_ok=True)
    save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(config, indent=2))
    (out / "generation_config.json").write_text(json.dumps(generation, indent=2))
    tok.tokenizer.save(str(out / "tokenizer.json"))
    tok_config = dict(tok.config)
    template = meta.get("tokenizer.chat_template")
    if isinstance(template, str) and template:
        tok_config["chat_template"] = template
        (out / "chat_template.jinja").write_text(template, encoding="utf-8")
    (out / "tokenizer_config.json").write_text(json.dumps(tok_config, indent=2, ensure_ascii=False))
    return out
