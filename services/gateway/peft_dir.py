"""What the gateway can check of a PEFT LoRA directory before any worker reads it.

    info = read_peft_dir("/adapters/sql-lora", max_rank=64)   # PeftDirError: a message for a 400
    info.path, info.rank, info.targets, info.base_hint, info.nbytes

It reads `adapter_config.json` only (rank, target modules, peft type, the base model it names)
and checks that `adapter_model.safetensors` is there; the tensors themselves (shapes against
the base model, unsupported features) are checked by each worker as it loads them, and a worker's
refusal becomes a 400 too. Blocking file I/O: call it off the event loop. A relative path is
taken from the gateway's working directory, as vLLM does; the workers get the absolute path, so
gateway and workers must see the adapter under the same path (same host, or the same mount).
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from shared.events.base import MAX_PATH_CHARS

# The projections the engine applies LoRA to (services/gpu_worker/engine/lora.py TARGETS);
# repeated here so the gateway does not import the engine (and torch).
SUPPORTED_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
MAX_CONFIG_BYTES = 1 << 20
WEIGHTS_FILE = "adapter_model.safetensors"


class PeftDirError(ValueError):
    """Why the directory cannot be a LoRA adapter of this cluster (for the client)."""


@dataclass(frozen=True)
class PeftDir:
    path: Path  # absolute
    rank: int
    targets: list[str]
    base_hint: str  # adapter_config.json's base_model_name_or_path ("" when absent)
    nbytes: int  # size of the weights file


def read_peft_dir(raw_path: str, max_rank: int) -> PeftDir:
    try:
        return _read(raw_path, max_rank)
    except PeftDirError:
        raise
    except (OSError, ValueError) as exc:  # a name too long, a NUL byte, no permission, ...
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else type(exc).__name__
        raise PeftDirError(f"No LoRA adapter found at {raw_path[:256]!r}: it cannot be read ({reason})") from None


def _read(raw_path: str, max_rank: int) -> PeftDir:
    shown = raw_path[:256]
    path = Path(raw_path).expanduser()
    path = (path if path.is_absolute() else Path.cwd() / path).resolve()
    if not path.is_dir():
        raise PeftDirError(f"No LoRA adapter found at {shown!r}: not a directory this server can read")
    if len(str(path)) > MAX_PATH_CHARS:
        raise PeftDirError(f"{shown!r}: the absolute path is longer than {MAX_PATH_CHARS} characters")
    config_path = path / "adapter_config.json"
    raw = _read_config(config_path, shown)
    if raw.get("peft_type", "LORA") != "LORA":
        raise PeftDirError(f"{shown!r}: peft_type {str(raw.get('peft_type'))[:64]!r} is not LORA")
    rank = raw.get("r")
    if not isinstance(rank, int) or isinstance(rank, bool) or rank < 1:
        raise PeftDirError(f"{shown!r}: adapter_config.json needs 'r', a positive integer (the rank)")
    if rank > max_rank:
        raise PeftDirError(f"{shown!r}: rank {rank} is above this cluster's max_lora_rank ({max_rank})")
    targets = _targets(raw.get("target_modules"), shown)
    weights = path / WEIGHTS_FILE
    if not weights.is_file():
        also = " (adapter_model.bin is not supported: save with safetensors)" if (path / "adapter_model.bin").exists() \
            else ""
        raise PeftDirError(f"{shown!r} has no {WEIGHTS_FILE}{also}")
    base_hint = raw.get("base_model_name_or_path")
    return PeftDir(path=path, rank=rank, targets=targets, base_hint=base_hint if isinstance(base_hint, str) else "",
                   nbytes=weights.stat().st_size)


def _read_config(config_path: Path, shown: str) -> dict[str, Any]:
    try:
        if config_path.stat().st_size > MAX_CONFIG_BYTES:
            raise PeftDirError(f"{shown!r}: adapter_config.json is larger than {MAX_CONFIG_BYTES} bytes")
        raw = json.loads(config_path.read_bytes())
    except FileNotFoundError:
        raise PeftDirError(f"No LoRA adapter found at {shown!r}: it has no adapter_config.json") from None
    except (OSError, ValueError) as exc:  # unreadable, not UTF-8, not JSON
        raise PeftDirError(f"{shown!r}: adapter_config.json is not readable JSON ({type(exc).__name__})") from None
    if not isinstance(raw, dict):
        raise PeftDirError(f"{shown!r}: adapter_config.json is not a JSON object")
    return raw


def _targets(modules: object, shown: str) -> list[str]:
    """PEFT's target_modules (names, dotted paths, or "all-linear") as the projections it names."""
    if modules == "all-linear":
        return sorted(SUPPORTED_TARGETS)
    if isinstance(modules, str):
        modules = [modules]  # one module name (PEFT would also take it as a regex: not supported)
    if not isinstance(modules, list) or not modules or not all(isinstance(m, str) for m in modules):
        raise PeftDirError(f"{shown!r}: adapter_config.json needs 'target_modules', a list of module names")
    names = {m.rsplit(".", 1)[-1] for m in modules}
    unsupported = sorted(n for n in names if n not in SUPPORTED_TARGETS)
    if unsupported:
        raise PeftDirError(f"{shown!r}: target modules {', '.join(u[:64] for u in unsupported[:8])} are not "
                           f"supported (supported: {', '.join(SUPPORTED_TARGETS)})")
    return sorted(names)


__all__ = ["PeftDir", "PeftDirError", "SUPPORTED_TARGETS", "read_peft_dir"]
