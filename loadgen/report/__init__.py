"""Reports from per-request records: latency percentiles, SLO attainment, throughput,
a markdown table and PNG plots. The same code serves live and simulated runs."""
from loadgen.report.metrics import ReportSummary, SloSpec, summarize_records
from loadgen.report.records import MemorySample, PlanMarker, RequestRecord
from loadgen.report.write import write_report

__all__ = ["MemorySample", "PlanMarker", "ReportSummary", "RequestRecord", "SloSpec", "summarize_records",
           "write_report"]
