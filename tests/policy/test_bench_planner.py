"""`tidal bench planner` at tiny scale: it runs, writes its outputs, and ends with the summary line."""
from __future__ import annotations

import json
import re
from pathlib import Path

from tidal.cli import main


def test_bench_planner_prints_the_summary_line_and_writes_its_figures(tmp_path: Path, capsys) -> None:
    out = tmp_path / "bench"
    assert main(["bench", "planner", "--devices", "64", "512", "--requests-per-device", "2",
                 "--out", str(out)]) == 0
    last = capsys.readouterr().out.strip().splitlines()[-1]
    m = re.fullmatch(r"bench planner: ms_per_op_64=(\d+\.\d{3}) ms_per_op_512=(\d+\.\d{3}) "
                     r"baseline_ms_per_op_64=(\d+\.\d{3})", last)
    assert m, last
    figures = json.loads((out / "summary.json").read_text())
    assert set(figures) == {"64", "512"}
    for fleet in figures.values():
        assert fleet["mell"]["ops"] > 0 and fleet["mell"]["refused"] == 0
        assert fleet["mell_batched"]["ops"] == fleet["mell"]["ops"]
        assert fleet["baseline_first_fit"]["ops"] == fleet["mell"]["ops"]
    assert (out / "report.txt").read_text().strip().splitlines()[-1] == last
