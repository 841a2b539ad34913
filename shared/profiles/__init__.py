"""Profile data files of the pure policies, and the one function that reads them.

The policies (`shared/policy/`) do no I/O: they decode bytes. This is the edge that turns a
path, or the name of a built-in profile in this directory, into those bytes.
"""
from __future__ import annotations

from pathlib import Path

from shared.policy.kunserve_profile import PipelineProfile, decode_pipeline_profile

PROFILES_DIR = Path(__file__).parent
DEFAULT_PIPELINE_PROFILE = "kunserve-qwen2.5-14b-a800"


def resolve_profile(source: str | Path, builtins: Path) -> Path:
    """`source` as a path, or, when no such file exists, the built-in `<builtins>/<source>.toml` of that name
    (every profile loader's rule: a user's file wins over a built-in's name)."""
    path = Path(source)
    builtin = builtins / f"{source}.toml"
    return builtin if not path.is_file() and builtin.is_file() else path


def builtin_pipeline_profiles() -> list[str]:
    return sorted(p.stem for p in PROFILES_DIR.glob("kunserve-*.toml"))


def load_pipeline_profile(source: str | Path = DEFAULT_PIPELINE_PROFILE) -> PipelineProfile:
    """KunServe's pipeline cost model from a .toml/.json file, or a built-in by name."""
    path = resolve_profile(source, PROFILES_DIR)
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise ValueError(f"pipeline profile {source}: cannot read ({exc.strerror}); "
                         f"built-ins: {', '.join(builtin_pipeline_profiles())}") from None
    return decode_pipeline_profile(data, origin=str(path), fmt="json" if path.suffix == ".json" else "toml")


__all__ = ["DEFAULT_PIPELINE_PROFILE", "PROFILES_DIR", "builtin_pipeline_profiles", "load_pipeline_profile",
           "resolve_profile"]
