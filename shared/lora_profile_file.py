"""Reading `tidal profile lora`'s file and building the routing options from the config.

The I/O half of `shared/policy/lora_perf_model.py` (which is pure): the dispatcher and the
simulator call `routing_options(cfg)` so both route with the same model, kernel and SLO.
"""
from __future__ import annotations

from pathlib import Path

from shared.config import ClusterConfig
from shared.policy.lora_perf_model import PAPER_PROFILE, LoraPerfProfile, decode_profile
from shared.policy.lora_routing import RoutingOptions


def load_lora_profile(path: str | Path | None) -> LoraPerfProfile:
    """The profile at `path` (.json, or .toml); None gives the paper's Fig. 5 numbers."""
    if path is None:
        return PAPER_PROFILE
    path = Path(path)
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise ValueError(f"LoRA profile {path}: cannot read ({exc.strerror})") from None
    return decode_profile(data, source=f"LoRA profile {path}", toml=path.suffix == ".toml")


def routing_options(cfg: ClusterConfig, profile: LoraPerfProfile | None = None) -> RoutingOptions:
    """`[dispatcher] lora_profile`, `[policies] lora_kernel`, `[slo] tpot` and the workers'
    `lora_load_bandwidth` (pricing cold loads) as RoutingOptions."""
    if profile is None:
        profile = load_lora_profile(cfg.dispatcher.lora_profile)
    tpot = cfg.slo.tpot
    kernel = cfg.policies.lora_kernel
    profile.model(kernel)  # a profile without the configured kernel is refused at start, not per request
    bandwidth = {w.id: float(w.lora_load_bandwidth) for w in cfg.workers if w.lora_load_bandwidth}
    return RoutingOptions(profile=profile, kernel=kernel, tpot_slo_s=tpot.absolute_s, slo_factor=tpot.factor,
                          load_bandwidth=bandwidth, default_load_bandwidth=profile.adapter_load_bytes_per_s)


__all__ = ["load_lora_profile", "routing_options"]
