"""`--profile FILE|h200-measured` for `tidal sim` and every `tidal repro`: one helper.

A repro's simulation then runs on the measured device: the profile is made active for the run
(and its worker processes) and every cost profile it loads takes the device's numbers
(loadgen/sim/measured_overlay.py says which); the report gets a section listing which numbers
were measured, how, and which stayed cited. `tidal sim --profile` takes a measured profile as
its whole cost model (as any profile), and its report gets the same per-field sources.
"""
from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path

HELP = ("a measured device profile (`tidal profile gpu --out FILE`, or the built-in h200-measured): the simulation "
        "runs on its measured step times, host link, adapter load and engine start; the report says which "
        "numbers are measured and which cited")


def add_profile_option(p: argparse.ArgumentParser) -> None:
    if any(a.dest == "profile" for a in p._actions):
        return  # the command has its own --profile (caraserve --live: its LoRA profile); measured_run shares it
    p.add_argument("--profile", default=None, metavar="FILE|NAME", help=HELP)


def _append(report: Path, lines: list[str]) -> Path:
    target = report if report.is_file() else report.with_name("profile-sources.md")
    with target.open("a") as f:
        f.write("\n" + "\n".join(lines) + "\n")
    return target


def measured_run(paper: str, run: Callable[[argparse.Namespace], int]) -> Callable[[argparse.Namespace], int]:
    """`run` with the measured profile of `--profile` active around it, and the report's section after."""
    def wrapped(args: argparse.Namespace) -> int:
        from loadgen.repro.report import default_out
        from loadgen.sim.measured_overlay import report_lines, resolve_measured, use_measured

        source = getattr(args, "profile", None)
        if source is None or (paper == "caraserve" and getattr(args, "live", False)):
            return run(args)  # caraserve --live: --profile is its `tidal profile lora` file, as before
        if getattr(args, "live", False):
            print("error: --profile applies to the simulated runs; --live runs local CPU workers", file=sys.stderr)
            return 2
        try:
            path = resolve_measured(source)
            measured = use_measured(path)
        except ValueError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
        assert measured is not None
        if getattr(args, "out", None) is None:
            args.out = str(default_out(paper))
        try:
            rc = run(args)
        finally:
            use_measured(None)
        target = _append(Path(args.out) / "report.md", report_lines(measured, str(path)))
        print(f"profile {measured.name}: measured numbers laid over the paper's cited ones; sources in {target}")
        return rc

    return wrapped


def sim_sources(out: str | Path, profile) -> list[str]:  # type: ignore[no-untyped-def]
    """`tidal sim` on a measured profile: its per-field sources into the report (none for a cited one)."""
    from loadgen.sim.profile_sources import count_sources, source_lines

    if not profile.sources:
        return []
    fields, n = count_sources(profile.sources)
    lines = ["## Measured and cited numbers", "",
             f"Profile `{profile.name}`: {n} of {fields} fields measured"
             + (f" on {profile.device.device}, {profile.device.date}" if profile.device else "") + ".", "",
             *source_lines(profile.sources)]
    _append(Path(out) / "report.md", lines)
    return [f"profile {profile.name}: {n} of {fields} fields measured (sources in the report)"]
