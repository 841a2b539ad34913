"""Every `tidal bench …` and `tidal repro …` runs from a folder that is not the repository, with its default
output directory: at its smallest setting, as a user would type it (`python -m tidal`, cwd a temporary folder,
no --out), its files land under that folder's runs/ and nothing is written into the repository.

A relative path must be resolved once, against the cwd the user gave it in: a bench that writes a cluster
config inside its run directory once resolved `runs/lora-…` a second time against the config's own folder.
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tidal.cli import build_parser

# (argv, whether it writes files under runs/): the smallest setting of each; live repros start local clusters
CASES: dict[str, tuple[list[str], bool]] = {
    "bench bus": (["bench", "bus", "--requests", "50", "--rounds", "1", "--warmup", "5", "--concurrency", "4"], False),
    "bench engine": (["bench", "engine", "--layers", "1", "--hidden", "64", "--heads", "4", "--kv-heads", "2",
                      "--vocab", "512", "--max-position", "128", "--num-requests", "4", "--curve-batches", "1,2",
                      "--curve-context", "16", "--curve-steps", "2", "--skip-baseline"], True),
    "bench sim": (["bench", "sim", "--duration", "20", "--rate", "5", "--workers", "2", "--slice", "5"], False),
    "bench gateway": (["bench", "gateway", "--streams", "2", "--rounds", "1", "--prompt-len", "8", "--output-len", "4",
                       "--unloaded", "1", "--repeat", "1", "--idle-gap", "0", "--memory", "128MiB"], False),
    "bench fidelity": (["bench", "fidelity", "--workers", "1", "--rate", "1", "--duration", "3", "--prompt-tokens", "16",
                        "--output-tokens", "4", "--no-calibrate", "--memory", "128MiB"], True),
    "bench fidelity --pressure": (["bench", "fidelity", "--pressure", "--rate", "1", "--duration", "3",
                                   "--prompt-tokens", "16", "--output-tokens", "8", "--kv-tokens", "128",
                                   "--profile-passes", "1", "--calibration-batch", "1", "--memory", "128MiB"], True),
    "bench transfer": (["bench", "transfer", "--size-mib", "4", "--repeats", "1", "--only", "a"], False),
    "bench migrate": (["bench", "migrate", "--lengths", "32", "--repeats", "1", "--max-tokens", "64",
                       "--decode-before", "2", "--memory", "256MiB"], True),  # a smaller model ends before it moves
    "bench planner": (["bench", "planner", "--devices", "64", "--requests-per-device", "1"], True),
    "bench predictor": (["bench", "predictor", "--days", "2", "--rate", "0.5", "--window", "600"], True),
    "bench lora": (["bench", "lora", "--requests", "2", "--rate", "4", "--prompt-len", "8", "16", "--output-len", "2",
                    "--rounds", "1", "--modes", "cached,cached_bgmv,ondemand"], True),
    "bench lora-invoke": (["bench", "lora-invoke", "--device", "cpu", "--layers", "1", "--hidden", "64", "--heads", "4",
                           "--tokens", "8", "--processes", "1", "--warmup", "0", "--repeats", "1", "--pool-mib", "64"],
                          True),
    "bench kunserve-exchange": (["bench", "kunserve-exchange", "--layers", "2", "--hidden", "64", "--heads", "4",
                                 "--requests", "1", "--prompt", "16", "--warmup", "1", "--steps", "2",
                                 "--pool-mib", "64"], True),
    "repro mell": (["repro", "mell", "--scale", "tiny", "--workloads", "poisson-1.1", "--no-plots"], True),
    "repro caraserve": (["repro", "caraserve", "--scale", "tiny", "--duration", "5", "--no-plots"], True),
    "repro kunserve": (["repro", "kunserve", "--scale", "tiny", "--no-ablation", "--no-plots"], True),
    "repro warmserve": (["repro", "warmserve", "--scale", "tiny", "--no-plots"], True),
    "repro mell --live": (["repro", "mell", "--live", "--duration", "4", "--rate", "0.5"], True),
    "repro caraserve --live": (["repro", "caraserve", "--live", "--workers", "1", "--adapters", "4", "--rate", "1",
                                "--duration", "5"], True),
    "repro kunserve --live": (["repro", "kunserve", "--live", "--workers", "2"], True),
    "repro warmserve --live": (["repro", "warmserve", "--live", "--duration", "16", "--runs", "1"], True),
    "repro economy": (["repro", "economy", "--scale", "tiny", "--no-plots"], True),
    "repro economy --live": (["repro", "economy", "--live", "--duration", "10"], True),
    "repro prefix": (["repro", "prefix", "--minutes", "1"], False),
    "bench prefix": (["bench", "prefix", "--arms", "on", "--duration", "4", "--chat-rate", "0.25",
                      "--system-rate", "0.5", "--system-tokens", "64"], True),
}
# `tidal bench serve` needs a running gateway: tests/e2e/test_e2e_trace_serve.py runs it from another folder
ELSEWHERE = {"bench serve"}


def subcommands(parent: str) -> set[str]:
    """The names `tidal <parent> --help` lists."""
    parser = build_parser()
    sub = next(a for a in parser._subparsers._group_actions if a.dest == "command")  # type: ignore[union-attr]
    child = sub.choices[parent]
    nested = next(a for a in child._subparsers._group_actions)  # type: ignore[union-attr]
    return {f"{parent} {name}" for name in nested.choices}


def test_every_bench_and_repro_is_run_here() -> None:
    covered = {name.split(" --")[0] for name in CASES} | ELSEWHERE
    assert subcommands("bench") | subcommands("repro") <= covered


@pytest.mark.timeout(600)
@pytest.mark.parametrize("name", sorted(CASES))
def test_runs_with_its_default_output_from_another_folder(name: str, tmp_path: Path) -> None:
    argv, writes = CASES[name]
    done = subprocess.run([sys.executable, "-m", "tidal", *argv], cwd=tmp_path, capture_output=True, text=True,
                          timeout=580, env={**os.environ, "MPLBACKEND": "Agg"})
    assert done.returncode == 0, f"tidal {' '.join(argv)}\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    assert "Traceback" not in done.stderr, done.stderr[-3000:]
    runs = list((tmp_path / "runs").glob("*")) if (tmp_path / "runs").is_dir() else []
    if writes:
        assert len(runs) == 1 and any(p.is_file() for p in runs[0].rglob("*")), (runs, done.stdout[-2000:])
