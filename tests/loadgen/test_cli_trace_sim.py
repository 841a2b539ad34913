"""`tidal trace ...` and `tidal sim ...` end to end (real files, no mocks)."""
from __future__ import annotations

import json
from pathlib import Path

from loadgen.report.write import read_summary
from loadgen.traces.io import read_trace
from loadgen.traces.schema import BurstGPTParams, MAFParams
from tidal.cli import main


def test_trace_kinds_write_readable_files(tmp_path: Path, capsys) -> None:
    assert main(["trace", "burstgpt", "--duration", "2m", "--rate", "1", "--burst", "30:20:14",
                 "--dataset", "azureconv", "--out", str(tmp_path / "b.jsonl")]) == 0
    burst = read_trace(tmp_path / "b.jsonl")
    assert isinstance(burst.header.params, BurstGPTParams) and burst.header.duration_s == 120.0
    assert [(b.start_s, b.duration_s, b.magnitude) for b in burst.header.params.bursts] == [(30.0, 20.0, 14.0)]
    assert main(["trace", "maf", "--duration", "30", "--adapters", "300", "--models", "2", "--ranks", "8,64",
                 "--out", str(tmp_path / "m.jsonl")]) == 0
    maf = read_trace(tmp_path / "m.jsonl")
    assert isinstance(maf.header.params, MAFParams) and {a.rank for a in maf.header.adapters} == {8, 64}
    assert main(["trace", "azure", "--duration", "1h", "--model-names", "x,y", "--kinds", "conv,code",
                 "--out", str(tmp_path / "a.jsonl")]) == 0
    assert read_trace(tmp_path / "a.jsonl").models() == ["x", "y"]
    assert main(["trace", "poisson", "--rate", "4", "--duration", "10", "--time-scale", "2",
                 "--out", str(tmp_path / "p.jsonl")]) == 0
    fast = read_trace(tmp_path / "p.jsonl")
    assert fast.header.duration_s == 5.0 and fast.header.time_scale == 2.0
    capsys.readouterr()
    assert main(["trace", "info", str(tmp_path / "p.jsonl")]) == 0
    assert "PoissonParams" in capsys.readouterr().out


def test_trace_csv_import_and_errors(tmp_path: Path, capsys) -> None:
    csv = tmp_path / "az.csv"
    csv.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46.68,374,44\n"
                   "2023-11-16 18:15:50.99,396,109\n")
    assert main(["trace", "azure", "--csv", str(csv), "--model", "conv", "--out", str(tmp_path / "a.jsonl")]) == 0
    assert [r.prompt_tokens for r in read_trace(tmp_path / "a.jsonl").records] == [374, 396]
    assert main(["trace", "azure", "--csv", str(tmp_path / "missing.csv"), "--out", str(tmp_path / "x")]) == 2
    assert "cannot read" in capsys.readouterr().err
    assert main(["trace", "azure", "--kinds", "chat", "--out", str(tmp_path / "x")]) == 2
    assert "unknown kind" in capsys.readouterr().err


def test_sim_writes_the_report(tmp_path: Path, capsys) -> None:
    trace = tmp_path / "t.jsonl"
    assert main(["trace", "poisson", "--rate", "2", "--duration", "60", "--out", str(trace)]) == 0
    out = tmp_path / "sim"
    assert main(["sim", str(trace), "--workers", "3", "--out", str(out), "--slo-scale", "5",
                 "--kv-blocks", "1024"]) == 0
    for name in ("records.jsonl", "summary.json", "report.md", "cdf.png", "timeline.png", "sim.json", "occupancy.png"):
        assert (out / name).exists(), name
    assert "engine mode chunked" in (out / "report.md").read_text()
    summary = read_summary(out / "summary.json")
    assert summary.requests == len(read_trace(trace).records) == summary.completed
    assert summary.slo is not None and summary.slo.slo.ttft_s > 0
    info = json.loads((out / "sim.json").read_text())
    assert info["workers"] == 3 and info["profile"]["worker"]["kv_blocks"] == 1024
    assert "| TTFT |" in capsys.readouterr().out
    assert main(["sim", str(tmp_path / "nope.jsonl"), "--workers", "2", "--out", str(out)]) == 2
    assert "cannot read trace" in capsys.readouterr().err
    assert main(["sim", str(trace), "--workers", "2", "--profile", "tpu", "--out", str(out)]) == 2
