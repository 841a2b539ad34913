"""A measured profile laid over the papers' cited ones: which numbers it replaces, that every
`tidal repro` and `tidal sim` take `--profile`, and that the reports say what was measured."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import msgspec
import pytest

from loadgen.profiler.gpu_profile_build import build_profile
from loadgen.sim import measured_overlay
from loadgen.sim.fleet_profile import load_fleet_profile
from loadgen.sim.profile import MEASURED_ENV, load_profile, save_profile
from tidal.cli import build_parser
from tests.measured_run import fake_run
from tidal.commands.repro import PAPERS

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def measured_file(tmp_path: Path) -> Path:
    profile = build_profile(fake_run(), name="h200-test", command="tidal profile gpu --device cuda:0", date="d")
    return save_profile(tmp_path / "measured.json", profile)


def test_build_counts_and_sources() -> None:
    profile = build_profile(fake_run(cuda=False), name="cpu-test", command="c", date="d")
    assert profile.sources["device.graph_capture_s"].kind == "unmeasured" and profile.device.graph_capture_s is None
    gpu = build_profile(fake_run(), name="gpu-test", command="c", date="d")
    assert gpu.sources["device.graph_capture_s"].kind == "measured" and gpu.device.graph_capture_s == 0.05
    assert gpu.link("h2d").bandwidth_bytes_per_s == 50e9 and gpu.link("kv-copy").bandwidth_bytes_per_s == 2e12
    assert gpu.step == gpu.models["llama-8b"] != gpu.models["smollm2-135m"]


def test_overlay_replaces_device_numbers_and_keeps_the_papers(measured_file: Path,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(MEASURED_ENV, raising=False)
    cited = load_profile("a800-qwen2.5-14b")
    m = measured_overlay.use_measured(measured_file)
    try:
        over = load_profile("a800-qwen2.5-14b")
        fleet = load_fleet_profile("warmserve-h800-llama2")
    finally:
        measured_overlay.use_measured(None)
    assert m is not None and over.step == m.step != cited.step
    assert over.link("pcie").bandwidth_bytes_per_s == 50e9  # the host link: measured page-locked h2d
    assert over.link("rdma") == cited.link("rdma")  # between instances: cited
    assert over.worker.kv_blocks == cited.worker.kv_blocks and over.worker.adapter_load_s == 0.002
    assert over.sources["step"].kind == "measured" and over.sources["links.rdma"].kind == "cited"
    host = next(l for l in fleet.links if l.name == "host")
    assert fleet.startup.engine_init_s == 1.5 and host.bandwidth_bytes_per_s == 50e9
    assert load_profile("a800-qwen2.5-14b") == cited  # inactive again
    assert load_fleet_profile("warmserve-h800-llama2").startup.engine_init_s == 12.3


def test_every_repro_and_sim_take_profile() -> None:
    for paper in PAPERS:
        args = build_parser(["repro", paper]).parse_args(["repro", paper, "--profile", "h200-measured"])
        assert args.profile == "h200-measured", paper
    args = build_parser(["sim"]).parse_args(["sim", "t.jsonl", "--workers", "1", "--out", "o", "--profile", "x.json"])
    assert args.profile == "x.json"


def _tidal(*argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "tidal", *argv], cwd=ROOT, capture_output=True, text=True, timeout=280)


def test_bad_profiles_are_refused(tmp_path: Path) -> None:
    done = _tidal("repro", "kunserve", "--scale", "tiny", "--profile", str(tmp_path / "nosuch.json"))
    assert done.returncode == 2 and "nosuch.json: no such file" in done.stderr
    cited = tmp_path / "cited.json"
    save_profile(cited, load_profile("a800-qwen2.5-14b"))
    done = _tidal("repro", "kunserve", "--scale", "tiny", "--profile", str(cited))
    assert done.returncode == 2 and "not a measured profile" in done.stderr


@pytest.mark.slow
def test_repro_report_says_what_was_measured(measured_file: Path, tmp_path: Path) -> None:
    out = tmp_path / "kun"
    done = _tidal("repro", "kunserve", "--scale", "tiny", "--no-plots", "--no-ablation", "--profile",
                  str(measured_file), "--out", str(out))
    assert done.returncode == 0, done.stderr[-2000:]
    report = (out / "report.md").read_text()
    section = report[report.index("## Measured and cited numbers"):]
    assert "Measured profile `h200-test`" in section and "`step.overhead_s`" in section and "Cited (kept" in section
    assert "profile h200-test: measured numbers laid over" in done.stdout


def test_sim_report_lists_the_sources(measured_file: Path, tmp_path: Path) -> None:
    trace = tmp_path / "t.jsonl"
    assert _tidal("trace", "poisson", "--out", str(trace), "--duration", "5", "--rate", "2").returncode == 0
    done = _tidal("sim", str(trace), "--workers", "1", "--out", str(tmp_path / "sim"), "--no-plots",
                  "--profile", str(measured_file))
    assert done.returncode == 0, done.stderr[-2000:]
    report = (tmp_path / "sim" / "report.md").read_text()
    assert "Profile `h200-test`" in report and "`device.graph_capture_s`: measured" in report
    assert msgspec.json.decode(measured_file.read_bytes())["sources"]["request_overhead_s"]["kind"] == "cited"
