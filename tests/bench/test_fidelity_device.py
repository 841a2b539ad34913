"""`tidal bench fidelity --device cpu --profile FILE`: the device mode's code path on a CPU — the
engine built at the profile's geometry replays a trace and is compared with the simulator."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from loadgen.profiler.gpu_profile_build import build_profile
from loadgen.sim.profile import save_profile
from tests.measured_run import fake_run
from tidal.bench.fidelity_device import plan_for, summary_line

ROOT = Path(__file__).resolve().parents[2]


def test_plan_follows_the_profiles_geometry() -> None:
    cpu = build_profile(fake_run(cuda=False), name="c", command="c", date="d")
    plan = plan_for(cpu, "cpu")
    assert plan.name == "llama-8b" and plan.shape["layers"] == 1  # the quick CPU run's geometry
    with pytest.raises(ValueError, match="another geometry"):
        plan_for(build_profile(fake_run(cuda=True), name="g", command="c", date="d"), "cpu")
    assert summary_line("cuda:0", {"ttft_p50": 0.05, "ttft_p99": 0.123}) == \
        "bench fidelity (cuda:0): ttft_p50_err=5% ttft_p99_err=12%"


@pytest.mark.slow
def test_device_mode_runs_on_cpu(tmp_path: Path) -> None:
    profile = save_profile(tmp_path / "cpu.json", build_profile(fake_run(cuda=False), name="c", command="c", date="d"))
    done = subprocess.run([sys.executable, "-m", "tidal", "bench", "fidelity", "--device", "cpu", "--profile",
                           str(profile), "--requests", "4", "--out", str(tmp_path / "out")], cwd=ROOT,
                          capture_output=True, text=True, timeout=280)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip().splitlines()[-1].startswith("bench fidelity (cpu): ttft_p50_err=")
    result = json.loads((tmp_path / "out" / "fidelity-device.json").read_text())
    assert result["failed"] == 0 and result["requests"] >= 1
    for key in ("ttft_p50", "ttft_p99", "tpot_p50", "tpot_p99"):
        assert result["live"][key] > 0 and result["sim"][key] > 0, key
