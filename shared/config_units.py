"""Human-friendly value types of the cluster config: sizes, durations and SLO targets.

Each is a subclass of a builtin (`ByteSize` is an int of bytes, `Duration` a float of
seconds, `SloTarget` the string as written) so code uses them as plain numbers; `dec_hook`
parses them when msgspec decodes the config, and its ValueError names what was expected.
"""
from __future__ import annotations

import json
import math
import re
from typing import Any

_SIZE = re.compile(r"^\s*([0-9]+(?:\.[0-9]+)?)\s*([KMGTP]i?B|B)?\s*$", re.IGNORECASE)
_SIZE_UNITS = {
    "b": 1,
    "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12, "pb": 10**15,
    "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40, "pib": 2**50,
}
_DURATION = re.compile(r"^\s*([0-9]+(?:\.[0-9]+)?)\s*(us|ms|s|m|h|d)?\s*$")
_DURATION_UNITS = {"us": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}
_FACTOR = re.compile(r"^\s*([0-9]+(?:\.[0-9]+)?)\s*x\s*$")


def _show(value: Any) -> str:
    return json.dumps(value) if isinstance(value, (str, int, float, bool)) or value is None else type(value).__name__


class ByteSize(int):
    """A size in bytes; written as an integer or with a unit: "512MiB", "8GiB", "1.5GB"."""

    EXPECTED = 'a size like "8GiB" (B, KB, MB, GB, TB, KiB, MiB, GiB, TiB) or a number of bytes'

    @classmethod
    def parse(cls, value: Any) -> "ByteSize":
        if isinstance(value, bool):
            raise ValueError(f"expected {cls.EXPECTED}, got {_show(value)}")
        if isinstance(value, int):
            if value < 0:
                raise ValueError(f"expected a size >= 0, got {value}")
            return cls(value)
        match = _SIZE.match(value) if isinstance(value, str) else None
        if not match:
            raise ValueError(f"expected {cls.EXPECTED}, got {_show(value)}")
        number, unit = float(match.group(1)), (match.group(2) or "b").lower()
        return cls(int(number * _SIZE_UNITS[unit]))

    def human(self) -> str:
        for unit, scale in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
            if self >= scale and self % (scale // 1024 or 1) == 0:
                return f"{self / scale:g}{unit}"
        return f"{int(self)}B"


class Duration(float):
    """A duration in seconds; written as a number of seconds or with a unit: "250ms", "3s", "1h"."""

    EXPECTED = 'a duration like "250ms", "3s", "5m", "1h" or a number of seconds'

    @classmethod
    def parse(cls, value: Any) -> "Duration":
        if isinstance(value, bool):
            raise ValueError(f"expected {cls.EXPECTED}, got {_show(value)}")
        if isinstance(value, (int, float)):
            seconds = float(value)
        else:
            match = _DURATION.match(value) if isinstance(value, str) else None
            if not match:
                raise ValueError(f"expected {cls.EXPECTED}, got {_show(value)}")
            seconds = float(match.group(1)) * _DURATION_UNITS[match.group(2) or "s"]
        if not math.isfinite(seconds) or seconds < 0:
            raise ValueError(f"expected a duration >= 0, got {_show(value)}")
        return cls(seconds)


_BANDWIDTH = re.compile(r"^\s*([0-9]+(?:\.[0-9]+)?)\s*([KMGT]i?B|B)/s\s*$", re.IGNORECASE)


class Bandwidth(float):
    """Bytes per second; written as a number or with a unit: "16GB/s", "500MiB/s"."""

    EXPECTED = 'a bandwidth like "16GB/s" or "500MiB/s" (B, KB, MB, GB, TB, KiB, ... per second) or bytes/s'

    @classmethod
    def parse(cls, value: Any) -> "Bandwidth":
        if isinstance(value, bool):
            raise ValueError(f"expected {cls.EXPECTED}, got {_show(value)}")
        if isinstance(value, (int, float)):
            rate = float(value)
        else:
            match = _BANDWIDTH.match(value) if isinstance(value, str) else None
            if not match:
                raise ValueError(f"expected {cls.EXPECTED}, got {_show(value)}")
            rate = float(match.group(1)) * _SIZE_UNITS[match.group(2).lower()]
        if not math.isfinite(rate) or rate <= 0:
            raise ValueError(f"expected a bandwidth > 0, got {_show(value)}")
        return cls(rate)


class SloTarget(str):
    """A latency SLO: absolute ("500ms", "0.2s", 0.5) or relative to the unloaded P50 ("5x")."""

    EXPECTED = 'an SLO like "500ms" (absolute) or "5x" (times the unloaded P50)'

    @classmethod
    def parse(cls, value: Any) -> "SloTarget":
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            value = f"{value}s"
        if isinstance(value, str):
            factor = _FACTOR.match(value)
            if factor and float(factor.group(1)) > 0:
                return cls(value.strip())
            try:
                if Duration.parse(value) > 0:
                    return cls(value.strip())
            except ValueError:
                pass
        raise ValueError(f"expected {cls.EXPECTED}, got {_show(value)}")

    @property
    def factor(self) -> float | None:
        """k in "k x unloaded P50", or None for an absolute target."""
        match = _FACTOR.match(self)
        return float(match.group(1)) if match else None

    @property
    def absolute_s(self) -> float | None:
        return None if self.factor is not None else float(Duration.parse(str(self)))

    def seconds(self, unloaded_p50_s: float) -> float:
        """The target in seconds, given the unloaded P50 it may be relative to."""
        factor = self.factor
        return factor * unloaded_p50_s if factor is not None else float(Duration.parse(str(self)))


UNIT_TYPES: tuple[type, ...] = (ByteSize, Duration, SloTarget, Bandwidth)


def dec_hook(target: type, value: Any) -> Any:
    """msgspec decode hook: parse the unit types, refuse anything else."""
    if target in UNIT_TYPES:
        if isinstance(value, target):
            return value
        return target.parse(value)  # type: ignore[attr-defined]
    raise NotImplementedError(f"unsupported config type {target!r}")


def enc_hook(value: Any) -> Any:
    """msgspec encode hook: unit types encode as the builtin they extend."""
    for builtin in (int, float, str):
        if isinstance(value, builtin):
            return builtin(value)
    raise NotImplementedError(f"cannot encode {type(value).__name__}")


def schema_hook(target: type) -> dict[str, Any]:
    """JSON Schema of the unit types (for schemas/cluster-config.schema.json)."""
    if target is ByteSize:
        return {"anyOf": [{"type": "integer", "minimum": 0}, {"type": "string", "pattern": _SIZE.pattern}],
                "description": ByteSize.EXPECTED}
    if target is Duration:
        return {"anyOf": [{"type": "number", "minimum": 0}, {"type": "string", "pattern": _DURATION.pattern}],
                "description": Duration.EXPECTED}
    if target is SloTarget:
        return {"anyOf": [{"type": "number", "exclusiveMinimum": 0}, {"type": "string"}],
                "description": SloTarget.EXPECTED}
    if target is Bandwidth:
        return {"anyOf": [{"type": "number", "exclusiveMinimum": 0}, {"type": "string", "pattern": _BANDWIDTH.pattern}],
                "description": Bandwidth.EXPECTED}
    raise NotImplementedError(f"no schema for {target!r}")
