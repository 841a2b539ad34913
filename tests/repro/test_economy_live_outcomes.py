"""`tidal repro economy --live` reports how the arbiter's purchases ended, not how many were flagged bought:
the line's `applied=NN%` and the report's outcomes by source and refusals by reason."""
from __future__ import annotations

from pathlib import Path

import pytest

from loadgen.repro.economy_live import EconomyLiveConfig, EconomyLiveRun, LiveArm, write_live


def run() -> EconomyLiveRun:
    arb = LiveArm("arbiter", 1.0, 2.0, 40, 1, {"release_adapter": 4}, {"adapter": 4, "migrate": 2},
                  {"adapter": {"applied": 3, "refused": 1, "failed": 0}, "migrate": {"applied": 0, "refused": 0,
                                                                                     "failed": 1}},
                  {"busy": 1}, in_flight=1)
    fixed = LiveArm("fixed-order", 1.0, 3.0, 40, 0, {}, {})
    return EconomyLiveRun(EconomyLiveConfig(duration_s=30), {"fixed-order": fixed, "arbiter": arb})


def test_the_line_counts_outcomes_of_the_bought_effects() -> None:
    assert run().line() == ("repro economy (live): live_p99_ttft_vs_fixed_order=1.5x purchases=6 applied=60% "
                            "refused=1 failed=1 lost=1")  # 3 of the 5 that ended; one still in flight


def test_nothing_ended_is_a_dash_not_a_percentage() -> None:
    r = run()
    r.arms["arbiter"] = LiveArm("arbiter", 1.0, 2.0, 40, 0, {}, {})
    assert " applied=- refused=0 failed=0 " in r.line()


def test_the_report_has_outcomes_by_source_and_refusals_by_reason(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("loadgen.repro.economy_live.pool_plot", lambda path, _run: path)  # no figure needed here
    report = write_live(tmp_path, run(), "tidal repro economy --live").read_text()
    row = next(line for line in report.splitlines() if line.startswith("| arbiter |"))
    assert "{'adapter': '3/1/0', 'migrate': '0/0/1'} | {'busy': 1} | 1 |" in row
