"""`tidal bench lora-invoke` on a tiny model on the CPU: both invocations time steps that really
ran on the CPU LoRA helpers, and the summary line carries the keys docs/benchmarks.md quotes."""
from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

SUMMARY = re.compile(r"^bench lora-invoke: prefill_ms_sync_free=(\d+\.\d\d) prefill_ms_native=(\d+\.\d\d) "
                     r"prefill_gain=(-?\d+)%$", re.M)


def test_tiny_run_times_both_invocations_on_the_helpers(tmp_path: Path) -> None:
    out = tmp_path / "run"
    proc = subprocess.run(
        [sys.executable, "-m", "tidal.bench.lora_invoke", "--device", "cpu", "--layers", "2", "--hidden", "64",
         "--heads", "4", "--tokens", "32", "--processes", "1", "--warmup", "1", "--repeats", "2", "--out", str(out)],
        capture_output=True, text=True, timeout=240,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    match = SUMMARY.search(proc.stdout)
    assert match, proc.stdout
    times = json.loads((out / "steps.json").read_text())["times_s"]
    assert len(times["sync_free"]) == len(times["native"]) == 2
    assert float(match.group(1)) > 0 and float(match.group(2)) > 0
    assert "same memory copy" in proc.stdout  # on a CPU engine the two are not told apart
