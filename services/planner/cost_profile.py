"""The arbiter's cost profile (`[planner] cost_profile`): a simulator cost profile file, read here.

The planner prices moves, loads and restores with the simulator's own numbers: a path to a profile
(.toml or .json, as loadgen/sim/profiles/*.toml), or the name of a built-in one there. Only the parts the
planner needs are decoded (shared/policy/movement.decode_movement_profile: the links, `[movement]`, the
prefill cost of `[step]`); services never import loadgen, so the built-ins are found by their directory.
A bad path or a file without those parts fails the planner's start with a message naming it.
"""
from __future__ import annotations

from pathlib import Path

from shared.policy.movement import MovementProfile, decode_movement_profile
from shared.profiles import resolve_profile

SIM_PROFILES_DIR = Path(__file__).resolve().parents[2] / "loadgen" / "sim" / "profiles"


def builtin_cost_profiles() -> list[str]:
    return sorted(p.stem for p in SIM_PROFILES_DIR.glob("*.toml"))


def load_cost_profile(source: str | Path) -> MovementProfile:
    path = resolve_profile(source, SIM_PROFILES_DIR)
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise ValueError(f"[planner] cost_profile {str(source)!r}: cannot read {path} ({exc.strerror}); a path to a "
                         f"cost profile file, or one of {', '.join(builtin_cost_profiles())}") from None
    try:
        return decode_movement_profile(data, origin=str(path), fmt="json" if path.suffix == ".json" else "toml")
    except ValueError as exc:
        raise ValueError(f"[planner] cost_profile: {exc}") from None


__all__ = ["SIM_PROFILES_DIR", "builtin_cost_profiles", "load_cost_profile"]
