"""The cluster config: one TOML file, decoded with msgspec into typed, frozen Structs.

    cfg = load_config("cluster.toml")          # or load_config() for the embedded default
    cfg.gateway.port, cfg.registry.dead_after, cfg.workers[0].memory   # 8000, 3.0 (s), bytes

Environment variables `TIDAL__SECTION__KEY=value` override the file (nested keys and list
indexes too: `TIDAL__GATEWAY__LIMITS__MAX_TOKENS=512`, `TIDAL__WORKERS__1__MEMORY=4GiB`);
values go through the same typed decoder. A bad file or override is refused with a
`ConfigError` naming the key path and what was expected, e.g.
`config error: workers[1].memory: expected a size like "8GiB" ..., got "lots"`.
Unknown keys are refused too. Relative paths are resolved against the config file's
directory (the current directory for the embedded default). Reference: shared/default_cluster.toml.

The Structs are in config_schema.py and the reading in config_loader.py (which imports the schema);
this module is where callers take both from.
"""
from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import msgspec

from shared.config_schema import (
    DEFAULT_CONFIG_PATH, DEVICE_PATTERN, AdapterSpec, ClusterConfig, ClusterSection, ConfigError, DemoAdapter,
    DemoModel, DispatcherSection, GatewayLimits, GatewaySection, GgufSource, ModelSpec, ObservabilitySection,
    PlannerSection, PoliciesSection, PredictorSection, RateLimit, RegistrySection, Section, SloSection, WorkerSpec,
)


def load_config(path: str | os.PathLike[str] | None = None, *, env: Mapping[str, str] | None = None) -> ClusterConfig:
    """Load `path` (None: the embedded default) with `env` overrides (None: os.environ)."""
    from shared.config_loader import load

    return load(Path(path) if path is not None else None, os.environ if env is None else env)


def parse_config(text: str, *, source: str = "<string>", base_dir: Path | None = None,
                 env: Mapping[str, str] | None = None) -> ClusterConfig:
    """Parse TOML text (no environment overrides unless `env` is given)."""
    from shared.config_loader import parse

    return parse(text, source=source, base_dir=base_dir or Path.cwd(), env=env or {})


def config_to_builtins(cfg: ClusterConfig) -> dict[str, Any]:
    """The config as plain dicts/lists/numbers (for printing as JSON or TOML)."""
    from shared.config_units import enc_hook

    return msgspec.to_builtins(cfg, enc_hook=enc_hook)


__all__ = [
    "DEFAULT_CONFIG_PATH", "DEVICE_PATTERN", "AdapterSpec", "ClusterConfig", "ClusterSection", "ConfigError",
    "DemoAdapter", "DemoModel", "DispatcherSection", "GatewayLimits", "GatewaySection", "GgufSource", "ModelSpec",
    "ObservabilitySection", "PlannerSection", "PoliciesSection", "PredictorSection", "RateLimit", "RegistrySection",
    "Section", "SloSection", "WorkerSpec", "config_to_builtins", "load_config", "parse_config",
]
