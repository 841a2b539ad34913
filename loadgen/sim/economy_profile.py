"""The economy simulator's profile: which fleet, pipeline and LoRA cost models it runs on, and its
thresholds (loadgen/sim/profiles/economy/*.toml). Other profiles are named, never copied: the fleet
profile (GPUs, models, step and start times, links), KunServe's pipeline profile (efficiency by stage
count) and CaraServe's CPU-assist cost model (loadgen/repro/caraserve_cold.py's constants).

Derived here: the fleet profile with the economy's context length, each adapter's bytes and load
time (LoraGeometry, MovementCosts.load_s over the host link), and a cold adapter's CPU-assisted
extra time (CaraServe §4: the request's prefill runs its LoRA part on CPU cores while the adapter
loads; the GPU takes over when it lands, so the request is late by min(CPU time - GPU time, the
load)).
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import msgspec

from loadgen.repro import caraserve_cold
from loadgen.sim.fleet_profile import BLOCK_TOKENS, FleetModel, FleetProfile, load_fleet_profile
from loadgen.sim.lora_worker import LoraGeometry
from shared.policy.kunserve_profile import PipelineProfile
from shared.policy.movement import MovementCosts
from shared.profiles import load_pipeline_profile, resolve_profile

ECONOMY_DIR = Path(__file__).with_name("profiles") / "economy"
CPU_ASSIST_SOURCES = {"loadgen.repro.caraserve_cold": caraserve_cold}


class LoraSpec(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    hidden: int
    layers: int
    targets: int
    dtype_bytes: int = 2


class EconomySpec(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    name: str
    description: str = ""
    fleet: str
    pipeline: str
    max_model_len: int = 0
    batch_size: int = 0  # requests the dispatcher gives an instance at once and its engine's batch (0: the fleet's)
    adapter_slots: int = 32
    kv_high_watermark: float = 0.9
    layer_drop_at: float = 0.95
    restore_below: float = 0.5
    horizon_s: float = 10.0
    tick_s: float = 1.0
    adapter_models: list[str] = []
    lora: LoraSpec
    cpu_assist: str = "loadgen.repro.caraserve_cold"


@dataclass(frozen=True)
class EconomyProfile:
    spec: EconomySpec
    fleet: FleetProfile  # with the economy's context length
    pipeline: PipelineProfile
    geometry: LoraGeometry
    cpu_flops: float  # CaraServe's CPU LoRA helpers, all cores
    invoke_s: float  # CaraServe §4.2: a CPU LoRA invocation's overhead

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def adapter_models(self) -> list[str]:
        return list(self.spec.adapter_models)

    def movement(self) -> MovementCosts:
        return self.fleet.movement_costs()

    def block_bytes(self, m: FleetModel) -> int:
        return m.kv_bytes_per_token * BLOCK_TOKENS

    def adapter_bytes(self, rank: int) -> int:
        return self.geometry.adapter_bytes(rank)

    def adapter_load_s(self, rank: int) -> float:
        """An adapter onto one GPU over the host link (the one movement cost model)."""
        return self.movement().load_s(self.adapter_bytes(rank), in_host_memory=True)

    def cpu_prefill_s(self, tokens: int, rank: int) -> float:
        """CaraServe's CPU LoRA part of a prompt (caraserve_cold.cpu_lora_flop's formula, this geometry)."""
        g = self.geometry
        return tokens * rank * 2 * 2 * g.hidden * g.targets * g.layers / self.cpu_flops + self.invoke_s

    def cpu_assist_extra_s(self, tokens: int, rank: int, gpu_s: float, land_in_s: float) -> float:
        """How late a cold adapter's request gets its first token on CaraServe's path, over its GPU
        prefill `gpu_s`: caraserve_cold.simulate's max(gpu, min(cpu, land + gpu)) - gpu."""
        return max(0.0, min(self.cpu_prefill_s(tokens, rank) - gpu_s, land_in_s))


def with_models(fleet: FleetProfile, **overrides: int) -> FleetProfile:
    """The fleet profile with every model's fields in `overrides` replaced (a 0 keeps the model's own)."""
    changes = {k: v for k, v in overrides.items() if v}
    if not changes:
        return fleet
    return msgspec.structs.replace(fleet, models=[msgspec.structs.replace(m, **changes) for m in fleet.models])


def load_economy_profile(source: str | Path = "economy-h800") -> EconomyProfile:
    path = resolve_profile(source, ECONOMY_DIR)
    try:
        spec = msgspec.toml.decode(path.read_bytes(), type=EconomySpec)
    except OSError as exc:
        known = ", ".join(sorted(p.stem for p in ECONOMY_DIR.glob("*.toml")))
        raise ValueError(f"economy profile {source}: cannot read ({exc.strerror}); built-ins: {known}") from None
    except msgspec.DecodeError as exc:
        raise ValueError(f"economy profile {path}: {exc}") from None
    fleet = load_fleet_profile(spec.fleet)
    fleet = with_models(fleet, max_model_len=spec.max_model_len, batch_size=spec.batch_size)
    names = {m.name for m in fleet.models}
    if not set(spec.adapter_models) <= names:
        raise ValueError(f"economy profile {path}: adapter models {sorted(set(spec.adapter_models) - names)} "
                         f"are not in fleet profile {spec.fleet!r}")
    if not 0 < spec.restore_below < spec.kv_high_watermark <= spec.layer_drop_at <= 1:
        raise ValueError(f"economy profile {path}: need 0 < restore_below < kv_high_watermark <= layer_drop_at <= 1")
    if spec.horizon_s <= 0 or spec.tick_s <= 0 or spec.adapter_slots < 1:
        raise ValueError(f"economy profile {path}: horizon_s, tick_s > 0 and adapter_slots >= 1")
    source_mod = CPU_ASSIST_SOURCES.get(spec.cpu_assist)
    if source_mod is None:
        raise ValueError(f"economy profile {path}: cpu_assist must be one of {sorted(CPU_ASSIST_SOURCES)}")
    g = spec.lora
    return EconomyProfile(spec, fleet, load_pipeline_profile(spec.pipeline),
                          LoraGeometry(g.hidden, g.layers, g.targets, g.dtype_bytes),
                          source_mod.CPU_FLOPS_PER_CORE * source_mod.CPU_CORES, source_mod.INVOKE_S)


__all__ = ["EconomyProfile", "EconomySpec", "load_economy_profile", "with_models"]
