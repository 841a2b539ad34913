"""Write a run's report directory: records, summary, markdown and plots."""
from __future__ import annotations

from pathlib import Path

import msgspec

from loadgen.report.markdown import render_markdown
from loadgen.report.metrics import Columns, ReportSummary, SloSpec, summarize_records
from loadgen.report.plots import plot_cdfs, plot_timeline
from loadgen.report.records import MemorySample, PlanMarker, RequestRecord, write_records


def write_report(out_dir: str | Path, records: list[RequestRecord], *, slo: SloSpec | None = None,
                 title: str = "", memory: list[MemorySample] | None = None, plans: list[PlanMarker] | None = None,
                 extra: dict[str, str] | None = None, save_records: bool = True, plots: bool = True) -> ReportSummary:
    """Writes records.jsonl, summary.json, report.md, cdf.png and timeline.png under out_dir."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    summary = summarize_records(records, slo=slo, title=title)
    if save_records:
        write_records(out / "records.jsonl", records)
    (out / "summary.json").write_bytes(msgspec.json.format(msgspec.json.encode(summary)) + b"\n")
    (out / "report.md").write_text(render_markdown(summary, extra))
    if plots and records:
        cols = Columns(records)
        plot_cdfs(cols, out / "cdf.png", slo)
        plot_timeline(cols, out / "timeline.png", memory, plans, slo)
    return summary


def read_summary(path: str | Path) -> ReportSummary:
    path = Path(path)
    try:
        return msgspec.json.decode(path.read_bytes(), type=ReportSummary)
    except (OSError, msgspec.DecodeError) as exc:
        raise ValueError(f"{path}: not a report summary: {exc}") from None
