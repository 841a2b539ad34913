"""LoRA adapters in PEFT format: host store + device LRU cache charged to the memory pool.

An adapter directory holds `adapter_config.json` (r, lora_alpha, target_modules, ...) and
`adapter_model.safetensors` with keys like
`base_model.model.model.layers.3.self_attn.q_proj.lora_A.weight` ([r, in]) and
`...lora_B.weight` ([out, r]). Supported targets: q/k/v/o_proj and gate/up/down_proj.
The scaling (lora_alpha / r, or / sqrt(r) with use_rslora) is folded into B at load.

Adapters are read once into host memory (`register`) and copied to the device on demand
(`ensure_resident`) into an LRU cache; each resident adapter is charged to the pool as
kind "lora" and its charge released on eviction. A pinned adapter (`pin`) stays on the
device: LRU never evicts it. The host repository may be bounded (`host_limit_bytes`, the
worker's `lora_host_memory`): beyond it the least recently used adapters that have a
directory to re-read are spilled (registered still; read again on next use).
"""
from __future__ import annotations

import json
import math
import re
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file

from .adapter_lru import AdapterLRU
from .lora_batch import LoRABatch, build_lora_batch
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

    def to(self, device: torch.device) -> LoRAAdapter:
        moved = {key: (a.to(device), b.to(device)) for key, (a, b) in self.weights.items()}
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


class LoRAManager:
    """Host store of registered adapters and the device LRU cache (pool kind "lora")."""

    def __init__(
        self,
        cfg: ModelConfig,
        layers: Iterable[int],
        pool: Any,
        device: torch.device | str = "cpu",
        mode: str = "segmented",
        max_resident: int | None = None,
    ) -> None:
        self.cfg = cfg
        self.layers = sorted(layers)
        self.pool = pool
        self.device = torch.device(device)
        self.mode = mode
        self.max_resident = max_resident
        self.host: dict[str, LoRAAdapter] = {}
        self.resident: OrderedDict[str, tuple[LoRAAdapter, Any]] = OrderedDict()  # name -> (adapter, charge)
        self._stacks: dict[tuple[str, ...], dict] = {}  # padded path: stacked weights per adapter set
        self.pinned: set[str] = set()  # device level: never LRU-evicted
        self.host_lru = AdapterLRU()  # host copies held (spilled ones are not); bounded by host_limit_bytes
        self.paths: dict[str, Path] = {}  # where a spilled adapter is read again from
        self.spilled: dict[str, LoRAAdapter] = {}  # registered, weights dropped (name, rank kept)

    def set_host_limit(self, limit_bytes: int | None) -> None:
        self.host_lru.limit_bytes = limit_bytes

    def register(self, name: str, path: str | Path) -> LoRAAdapter:
        adapter = load_adapter(path, name, self.cfg, self.layers)
        self.install(adapter, path)
        return adapter

    def install(self, adapter: LoRAAdapter, path: str | Path | None = None, *, pinned: bool = False) -> None:
        """Register an adapter already read (`path`: its directory, so it may be spilled and re-read);
        pinned: made resident now and never LRU-evicted (MemoryError, and not registered, if no room)."""
        name = adapter.name
        self.unregister(name)
        self._hold(adapter)
        self.host[name] = adapter
        if path is not None:
            self.paths[name] = Path(path)
        else:
            self.host_lru.pin(name)  # nothing to read it back from: never spilled
        if pinned:
            try:
                self.pin(name)
            except MemoryError:
                self.unregister(name)
                raise

    def pin(self, name: str) -> None:
        self.ensure_resident([name])
        self.pinned.add(name)

    def unpin(self, name: str) -> None:
        self.pinned.discard(name)

    def unregister(self, name: str) -> None:
        self._evict(name)
        self.host.pop(name, None)
        self.pinned.discard(name)
        self.host_lru.remove(name)
        self.paths.pop(name, None)
        self.spilled.pop(name, None)

    def rank(self, name: str) -> int:
        return self.host[name].rank if name in self.host else self._host(name).rank

    def residency(self) -> list[tuple[str, str, bool, int, int]]:
        """(adapter, level "device" | "host", pinned, rank, bytes) per level each adapter is held at."""
        rows = [(n, "device", n in self.pinned, a.rank, a.nbytes) for n, (a, _) in self.resident.items()]
        rows += [(n, "host", n in self.pinned, self.host[n].rank, self.host_lru.size(n)) for n in self.host_lru]
        return rows

    def room_bytes(self) -> int:
        """Device bytes a newly loaded adapter could get: the pool's free bytes and unpinned adapters."""
        return self.pool.free_bytes + sum(a.nbytes for n, (a, _) in self.resident.items() if n not in self.pinned)

    def ensure_resident(self, names: Iterable[str]) -> None:
        """Load `names` to the device (LRU), evicting others not in `names` when short."""
        wanted = list(dict.fromkeys(names))
        for name in wanted:
            if name in self.resident:
                self.resident.move_to_end(name)
                continue
            adapter = self._host(name)
            if self.max_resident is not None:
                while len(self.resident) >= self.max_resident and self._evict_one(wanted):
                    pass
            while True:
                try:  # the pool first reclaims free KV blocks; then we evict cold adapters
                    charge = self.pool.charge("lora", f"lora:{name}", adapter.nbytes)
                    break
                except MemoryError as exc:
                    if not self._evict_one(wanted):
                        raise MemoryError(f"no room for LoRA adapter {name!r} ({adapter.nbytes} B): {exc}") from exc
            self.resident[name] = (adapter.to(self.device), charge)

    def reserve(self, name: str, keep: Iterable[str] = ()) -> tuple[LoRAAdapter, Any]:
        """Charge the pool for `name`'s device copy (evicting cold adapters not in `keep`, as
        `ensure_resident` does) without copying: the copy runs elsewhere (`lora_loads`) and
        `admit` makes it resident. Returns (host copy, charge); MemoryError if there is no room."""
        wanted = [name, *keep]
        adapter = self._host(name)
        if self.max_resident is not None:
            while len(self.resident) >= self.max_resident and self._evict_one(wanted):
                pass
        while True:
            try:
                return adapter, self.pool.charge("lora", f"lora:{name}", adapter.nbytes)
            except MemoryError as exc:
                if not self._evict_one(wanted):
                    raise MemoryError(f"no room for LoRA adapter {name!r} ({adapter.nbytes} B): {exc}") from exc

    def admit(self, name: str, source: LoRAAdapter, moved: LoRAAdapter, charge: Any) -> bool:
        """A reserved copy landed: resident from now on. False (charge released) if the adapter was
        unregistered or replaced while it was on its way."""
        current = self.host.get(name)
        if current is None or (current is not source and name not in self.spilled and current.weights):
            self.pool.release(charge)
            return False
        self.resident[name] = (moved, charge)
        return True

    def prepare_batch(self, adapters: list[str | None], q_lens: list[int]) -> LoRABatch | None:
        """Per-chunk adapter names → the step's LoRA hook (None when no chunk has one)."""
        names = sorted({a for a in adapters if a is not None})
        if not names:
            return None
        self.ensure_resident(names)
        resident = {n: self.resident[n][0] for n in names}
        stacks = None
        if self.mode == "padded":
            stacks = self._stacks.setdefault(tuple(names), {})
            while len(self._stacks) > 8:  # bounded: drop the oldest adapter sets
                self._stacks.pop(next(iter(self._stacks)))
        return build_lora_batch(self.mode, names, resident, adapters, q_lens, self.device, stacks)

    def clear(self) -> None:
        """Evict every resident adapter (their pool charges are released)."""
        for name in list(self.resident):
            self._evict(name)

    def _host(self, name: str) -> LoRAAdapter:
        adapter = self.host.get(name)
        if adapter is None:
            raise KeyError(f"unknown LoRA adapter {name!r} (registered: {sorted(self.host)})")
        if name in self.spilled:  # cold: read the directory again (it was checked when registered)
            adapter = load_adapter(self.paths[name], name, self.cfg, self.layers)
            self._hold(adapter)
            self.host[name] = adapter
            del self.spilled[name]
        else:
            self.host_lru.touch(name)
        return adapter

    def _hold(self, adapter: LoRAAdapter) -> None:
        """Count a host copy in the repository, spilling least recently used ones beyond its limit."""
        victims = self.host_lru.victims_for(adapter.nbytes, keep={adapter.name})
        if victims is None:
            raise MemoryError(f"LoRA adapter {adapter.name!r} ({adapter.nbytes} B) does not fit the host repository "
                              f"({self.host_lru.limit_bytes} B, {self.host_lru.bytes} B held by adapters it cannot spill)")
        for victim in victims:
            held = self.host[victim]
            self.spilled[victim] = LoRAAdapter(victim, held.rank, {})
            self.host[victim] = self.spilled[victim]
            self.host_lru.remove(victim)
        self.host_lru.add(adapter.name, adapter.nbytes)

    def _evict_one(self, keep: list[str]) -> bool:
        """Evict the least recently used adapter neither pinned nor in `keep`; False if there is none."""
        victim = next((n for n in self.resident if n not in keep and n not in self.pinned), None)
        if victim is not None:
            self._evict(victim)
        return victim is not None

    def _evict(self, name: str) -> None:
        entry = self.resident.pop(name, None)
        if entry is not None:
            self.pool.release(entry[1])
            self._stacks = {k: v for k, v in self._stacks.items() if name not in k}
