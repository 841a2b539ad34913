"""`tidal bench fidelity --pressure` end to end at its smallest: a real cluster (nats-server,
registry, dispatcher, one gpu_worker, gateway) whose worker has 24 KV blocks, a burst of 8
requests whose KV cannot all fit, and the simulator on the same budget. Timings on a shared host
prove nothing here; what must hold is the plumbing: the live engine preempted, its count reached
the bench through the worker's stats, and the simulator preempted too."""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.timeout(300)
def test_a_tiny_pressure_run_preempts_live_and_simulated(tmp_path: Path) -> None:
    mode = "vllm-0.6"  # the live worker runs the policy from [policies] scheduling (chunked: the default path)
    argv = ["bench", "fidelity", "--pressure", "--mode", mode, "--kv-tokens", "384", "--rate", "80",
            "--duration", "0.1", "--prompt-tokens", "64", "--output-tokens", "64", "--batch", "4", "--budget", "256",
            "--no-calibrate", "--profile-passes", "1", "--out", str(tmp_path / "out")]
    done = subprocess.run([sys.executable, "-m", "tidal", *argv], cwd=ROOT, capture_output=True, text=True,
                          timeout=280, env={**os.environ, "MPLBACKEND": "Agg"})
    assert done.returncode == 0, f"{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    assert "engine mode " + mode in done.stdout
    # 8 requests of 64 + 64 tokens, 4 at a time: 4 x 8 blocks at the end > 24 blocks
    line = done.stdout.strip().splitlines()[-1]
    m = re.fullmatch(r"bench fidelity: pressure_ttft_p99_err=\d+% pressure_tpot_p50_err=\d+% "
                     r"preemptions_live=(\d+) preemptions_sim=(\d+)", line)
    assert m, line
    assert int(m.group(1)) > 0 and int(m.group(2)) > 0
    assert (tmp_path / "out" / "live" / "report.md").is_file() and (tmp_path / "out" / "sim" / "report.md").is_file()
