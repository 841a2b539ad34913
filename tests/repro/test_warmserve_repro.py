"""`tidal repro warmserve` end to end at a tiny scale: deterministic, a parseable summary line, the files."""
from __future__ import annotations

import argparse
import dataclasses
import json
import re

import pytest

from loadgen.repro.warmserve import SCALES, SYSTEMS, run_point
from loadgen.repro.warmserve_setup import WORKLOADS
from loadgen.sim.fleet_profile import load_fleet_profile
from tidal.commands import repro_warmserve

LINE = re.compile(r"^repro warmserve: p99_ttft_vs_sllm=(\d+\.\d)x p99_ttft_vs_no_proactive=(\d+\.\d)x "
                  r"prewarm_hit=(\d{1,3})%$")


def test_tiny_run_prints_the_summary_line_and_writes_the_report(tmp_path, capsys) -> None:
    p = argparse.ArgumentParser()
    repro_warmserve.add_arguments(p)
    assert repro_warmserve.run(p.parse_args(["--scale", "tiny", "--out", str(tmp_path)])) == 0
    last = capsys.readouterr().out.strip().splitlines()[-1]
    m = LINE.match(last)
    assert m, last
    assert float(m.group(1)) > 1.0  # SLLM-GPU's cold starts cost it the tail
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["line"] == last
    assert {pt["rps"] for pt in summary["points"]} == set(SCALES["tiny"].rps)
    for name in ("report.md", "p99_ttft.png", "prewarm_hit.png", "tpot_cdf.png"):
        assert (tmp_path / name).stat().st_size > 0
    assert "50.79x" in (tmp_path / "report.md").read_text()  # beside the paper's numbers


def test_the_same_seed_gives_the_same_numbers() -> None:
    cfg = dataclasses.replace(SCALES["tiny"], day_s=240.0, window_s=60.0)
    profile = load_fleet_profile(cfg.profile)
    a, b = (run_point(profile, cfg, WORKLOADS["conv-a0.5"], 8.0) for _ in range(2))
    for s in SYSTEMS:
        assert (a.results[s].p99_ttft, a.results[s].starts) == (b.results[s].p99_ttft, b.results[s].starts)
        assert a.results[s].requests == b.results[s].requests > 0


def test_bad_options_are_refused(capsys) -> None:
    p = argparse.ArgumentParser()
    repro_warmserve.add_arguments(p)
    assert repro_warmserve.run(p.parse_args(["--scale", "tiny", "--workloads", "nope"])) == 2
    assert "unknown workload" in capsys.readouterr().err
    assert repro_warmserve.run(p.parse_args(["--scale", "tiny", "--rps", "5,-1"])) == 2
    assert "--rps" in capsys.readouterr().err
