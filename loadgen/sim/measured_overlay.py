"""A measured device profile (`tidal profile gpu`) laid over a paper's cited profile.

`tidal repro PAPER --profile FILE|h200-measured` runs the paper's experiment on the measured
device instead of the paper's: every cost profile the simulation loads (`load_profile`, and
`load_fleet_profile` for the fleet simulators) gets the measured numbers where the device
decides them, and keeps the paper's cited numbers where the model or the setting does:

- measured: the step model (every model of the profile takes the measured 8B-geometry step:
  its `models` entry of the same name when there is one), the host link that loads weights,
  adapters and dropped layers (`movement.host_link` <- the measured page-locked h2d rate and
  latency), a cold adapter's load (`worker.adapter_load_s`), and for fleets the engine start
  (`startup.engine_init_s`);
- cited: weights and KV bytes (the paper's model), KV blocks (the paper's card's memory), batch
  and token limits, the engine mode, network links between instances, the fleet's HBM and FLOP
  figures (roofline for models without measured times).

The measured profile reaches every process of a run (the mell scenarios run in a process pool)
through one environment variable, TIDAL_MEASURED_PROFILE, which `use_measured` sets; the
loaders (profile.py's `load_profile`, fleet_profile.py's) lay it over what they load when it is set.
"""
from __future__ import annotations

import os
from pathlib import Path

from loadgen.sim.profile import BUILTIN_DIR, MEASURED_ENV as ENV, CostProfile, active_measured, load_measured
from loadgen.sim.profile_overlay import overlay_cost, overlay_fleet

MEASURED_COST = ("step", "models.*", "links.<host_link>", "worker.adapter_load_s")
MEASURED_FLEET = ("links.<host_link>", "startup.engine_init_s")


def use_measured(path: str | Path | None) -> CostProfile | None:
    """Make `path` the measured profile of this process and its children (None: none); returns it."""
    if path is None:
        os.environ.pop(ENV, None)
        return None
    resolved = str(resolve_measured(path).resolve())
    profile = load_measured(resolved)
    os.environ[ENV] = resolved
    return profile


def resolve_measured(source: str | Path) -> Path:
    """A measured profile's file: `source` itself, or the built-in `loadgen/sim/profiles/<source>.json`
    (h200-measured, once a GPU run has written it)."""
    path = Path(source)
    if path.is_file():
        return path
    builtin = BUILTIN_DIR / f"{source}.json"
    if builtin.is_file():
        return builtin
    known = sorted(p.stem for p in BUILTIN_DIR.glob("*.json"))
    raise ValueError(f"--profile {source}: no such file and no built-in measured profile of that name "
                     f"(built-in: {', '.join(known) or 'none yet: `tidal profile gpu` on a device writes one'})")


def report_lines(m: CostProfile, source: str) -> list[str]:
    """The report's section: which numbers of the run are measured (how) and which cited."""
    from loadgen.sim.profile_sources import count_sources, source_lines

    assert m.device is not None
    fields, n = count_sources(m.sources)
    keep = {k: v for k, v in m.sources.items()
            if k.startswith(("step.", "links.", "worker.adapter_load_s", "device.engine_start_s"))}
    return [
        "## Measured and cited numbers",
        "",
        f"Measured profile `{m.name}` ({source}): {m.device.device}, {m.device.date}, `{m.device.command}`; "
        f"{n} of its {fields} fields measured.",
        "",
        f"Measured (replace the paper's cited numbers in every cost profile this run loaded): "
        f"{', '.join(MEASURED_COST)}; fleets: {', '.join(MEASURED_FLEET)}. Sources:",
        "",
        *source_lines(keep),
        "",
        "Cited (kept from the paper's profiles, loadgen/sim/profiles/): weights and KV bytes per token, KV blocks, "
        "batch and token limits, engine mode, the links between instances, fleets' HBM/FLOP rooflines and model mix.",
    ]


__all__ = ["ENV", "MEASURED_COST", "MEASURED_FLEET", "active_measured", "overlay_cost", "overlay_fleet",
           "report_lines", "resolve_measured", "use_measured"]
