"""What `tidal up` prints when a service does not start: the cause from the current run of its log."""
from __future__ import annotations

import json
from pathlib import Path

from tidal.start_report import MARKER, failure_cause, last_progress


def write_log(path: Path, *runs: list[str]) -> Path:
    lines = []
    for run in runs:
        lines.append(f"{MARKER} gpu_worker-cpu-0 at 2026-01-01T00:00:00 ---")
        lines += run
    path.write_text("\n".join(lines) + "\n")
    return path


def entry(event: str, level: str = "info", **fields: object) -> str:
    return json.dumps({"event": event, "level": level, **fields})


def test_the_cause_is_this_runs_errors_and_error_text_not_an_earlier_runs(tmp_path: Path) -> None:
    log = write_log(tmp_path / "w.log",
                    [entry("cannot load this worker's models", "error", error="an older failure")],
                    [entry("starting", progress="building the CPU attention kernel"),
                     "Traceback (most recent call last):",
                     "RuntimeError: Error building extension 'tidal_cpu_attn': interrupted by user",
                     entry("cannot load this worker's models", "error", error="model 'x': no checkpoint at /m/x")])
    cause = failure_cause(log)
    assert "an older failure" not in cause
    assert "Error building extension 'tidal_cpu_attn': interrupted by user" in cause
    assert "cannot load this worker's models error=model 'x': no checkpoint at /m/x" in cause
    assert last_progress(log) == "building the CPU attention kernel"


def test_without_an_error_line_the_last_lines_are_shown_and_a_missing_log_is_named(tmp_path: Path) -> None:
    log = write_log(tmp_path / "w.log", [entry(f"step {i}") for i in range(20)])
    cause = failure_cause(log, limit=3)
    assert [line.strip() for line in cause.splitlines()] == [entry("step 17"), entry("step 18"), entry("step 19")]
    assert "cannot read" in failure_cause(tmp_path / "absent.log")
    assert "has written nothing" in failure_cause(write_log(tmp_path / "empty.log", []))
