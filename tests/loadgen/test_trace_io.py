"""Trace files: round trip, clear errors, time scaling; CSV loaders for the public traces."""
from __future__ import annotations

from pathlib import Path

import pytest

from loadgen.traces.generate import generate
from loadgen.traces.io import TraceFormatError, read_trace, scale_time, write_trace
from loadgen.traces.loaders import TraceCsvError, load_azure_csv, load_burstgpt_csv
from loadgen.traces.schema import MAFParams, PoissonParams, TraceRecord


def test_round_trip_keeps_header_and_records(tmp_path: Path) -> None:
    trace = generate(MAFParams(seed=2, duration_s=20.0, rate=5.0, adapters=50))
    path = write_trace(tmp_path / "t.jsonl", trace)
    lines = path.read_bytes().splitlines()
    assert lines[0].startswith(b'{"tidal_trace":1') and b'"generator":"maf"' in lines[0]
    assert len(lines) == 1 + len(trace.records)
    back = read_trace(path)
    assert back.header == trace.header and back.records == trace.records
    assert isinstance(back.header.params, MAFParams)


def test_bad_files_are_named_with_line(tmp_path: Path) -> None:
    good = write_trace(tmp_path / "g.jsonl", generate(PoissonParams(duration_s=5.0, rate=2.0)))
    text = good.read_text().splitlines()
    bad = tmp_path / "bad.jsonl"
    bad.write_text("\n".join([text[0], text[1], '{"arrival_s": 1.0, "model": "m"}']) + "\n")
    with pytest.raises(TraceFormatError, match=r"bad\.jsonl:3: bad trace record"):
        read_trace(bad)
    bad.write_text('{"hello": 1}\n')
    with pytest.raises(TraceFormatError, match=r"bad\.jsonl:1: not a tidal trace header"):
        read_trace(bad)
    unordered = [text[0], text[2], text[1]]
    bad.write_text("\n".join(unordered) + "\n")
    with pytest.raises(TraceFormatError, match=r"bad\.jsonl:3: arrival_s .* before"):
        read_trace(bad)
    with pytest.raises(TraceFormatError, match="cannot read"):
        read_trace(tmp_path / "missing.jsonl")


def test_time_scaling_compresses_arrivals() -> None:
    trace = generate(PoissonParams(seed=1, duration_s=100.0, rate=1.0))
    fast = scale_time(trace, 4.0)
    assert fast.header.duration_s == 25.0 and fast.header.time_scale == 4.0
    assert [r.arrival_s for r in fast.records] == pytest.approx([r.arrival_s / 4 for r in trace.records], abs=1e-6)
    assert [r.prompt_tokens for r in fast.records] == [r.prompt_tokens for r in trace.records]
    with pytest.raises(ValueError, match="time scale must be > 0"):
        scale_time(trace, 0.0)


BURSTGPT_CSV = """Timestamp,Model,Request tokens,Response tokens,Total tokens,Log Type
5,ChatGPT,472,18,490,Conversation log
45,ChatGPT,1087,0,1087,Conversation log
118,GPT-4,417,334,751,API log
11,ChatGPT,1360,304,1664,Conversation log
300,GPT-4,20,7,27,Conversation log
"""


def test_burstgpt_csv_loader(tmp_path: Path) -> None:
    path = tmp_path / "burst.csv"
    path.write_text(BURSTGPT_CSV)
    trace = load_burstgpt_csv(path, model_map={"ChatGPT": "llama", "GPT-4": "qwen"})
    assert [(r.arrival_s, r.model, r.prompt_tokens, r.output_tokens) for r in trace.records] == [
        (0.0, "llama", 472, 18), (6.0, "llama", 1360, 304), (113.0, "qwen", 417, 334), (295.0, "qwen", 20, 7)]
    assert trace.header.params.rows_read == 5 and trace.header.params.rows_kept == 4  # the failed row is gone
    window = load_burstgpt_csv(path, start_s=5.0, duration_s=120.0, model="m", keep_failed=True)
    assert [(r.arrival_s, r.output_tokens) for r in window.records] == [(1.0, 304), (35.0, 1), (108.0, 334)]
    assert window.header.duration_s == 120.0 and window.models() == ["m"]
    api = load_burstgpt_csv(path, log_type="API log")
    assert len(api.records) == 1 and api.records[0].model == "GPT-4"


AZURE_CSV = """TIMESTAMP,ContextTokens,GeneratedTokens
2023-11-16 18:15:46.6805900,374,44
2023-11-16 18:15:50.9951690,396,109
2023-11-16 18:15:51.0000000,879,0
2023-11-16 18:16:10.1,2047,12
"""


def test_azure_csv_loader(tmp_path: Path) -> None:
    path = tmp_path / "azure.csv"
    path.write_text(AZURE_CSV)
    trace = load_azure_csv(path, model="conv")
    got = [(r.arrival_s, r.prompt_tokens, r.output_tokens) for r in trace.records]
    assert got == [(0.0, 374, 44), (pytest.approx(4.314579), 396, 109), (pytest.approx(4.31941), 879, 1),
                   (pytest.approx(23.41941), 2047, 12)]
    assert all(isinstance(r, TraceRecord) and r.model == "conv" for r in trace.records)


def test_csv_errors_name_the_problem(tmp_path: Path) -> None:
    path = tmp_path / "x.csv"
    path.write_text("TIMESTAMP,ContextTokens\n2023-11-16 18:15:46,3\n")
    with pytest.raises(TraceCsvError, match="missing column.*GeneratedTokens"):
        load_azure_csv(path)
    path.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46,3,4\nyesterday,3,4\n")
    with pytest.raises(TraceCsvError, match=r"x\.csv:3: bad TIMESTAMP 'yesterday'"):
        load_azure_csv(path)
    path.write_text(BURSTGPT_CSV.replace("472", "many"))
    with pytest.raises(TraceCsvError, match=r"x\.csv:2: bad Request tokens 'many'"):
        load_burstgpt_csv(path)


def test_burstgpt_csv_segment_slices_rows_and_compresses_time(tmp_path: Path) -> None:
    path = tmp_path / "burst.csv"
    path.write_text(BURSTGPT_CSV)
    seg = load_burstgpt_csv(path, offset_rows=1, count=3, time_divisor=10.0, keep_failed=True)
    # data rows 1..3: t = 45, 118, 11 -> / 10, relative to the earliest (1.1 s)
    assert sorted((round(r.arrival_s, 6), r.prompt_tokens) for r in seg.records) == [
        (0.0, 1360), (3.4, 1087), (10.7, 417)]
    assert seg.header.params.rows_read == 3
    with pytest.raises(TraceCsvError, match="no data rows at offset 99"):
        load_burstgpt_csv(path, offset_rows=99)
    with pytest.raises(TraceCsvError, match="time_divisor > 0"):
        load_burstgpt_csv(path, time_divisor=0)


def test_cli_replays_kunserves_segment_of_a_burstgpt_csv(tmp_path: Path) -> None:
    from loadgen.traces.io import read_trace
    from loadgen.traces.loaders import KUNSERVE_SEGMENT
    from tidal.cli import main

    first, n = KUNSERVE_SEGMENT["offset_rows"], KUNSERVE_SEGMENT["count"]
    rows = [f"{i},ChatGPT,{100 + i % 7},{1 + i % 5},0,Conversation log" for i in range(first + n + 10)]
    path = tmp_path / "BurstGPT.csv"
    path.write_text("Timestamp,Model,Request tokens,Response tokens,Total tokens,Log Type\n" + "\n".join(rows) + "\n")
    out = tmp_path / "seg.jsonl"
    assert main(["trace", "burstgpt", "--csv", str(path), "--kunserve-segment", "--model", "m", "--out", str(out)]) == 0
    trace = read_trace(out)
    assert len(trace.records) == n
    assert trace.records[-1].arrival_s == pytest.approx((n - 1) / 10)  # one row a second in the file, / 10
    assert trace.records[0].prompt_tokens == 100 + first % 7
