"""The report as a markdown table (milliseconds for latencies)."""
from __future__ import annotations

from loadgen.report.metrics import LatencyStats, ReportSummary


def _ms(v: float) -> str:
    return f"{v * 1000:.1f}"


def _pct(v: float | None) -> str:
    return "-" if v is None else f"{v * 100:.1f}%"


def _row(name: str, s: LatencyStats | None) -> str:
    if s is None:
        return f"| {name} | - | - | - | - | - | 0 |"
    return f"| {name} | {_ms(s.p50)} | {_ms(s.p90)} | {_ms(s.p99)} | {_ms(s.mean)} | {_ms(s.max)} | {s.count} |"


def render_markdown(summary: ReportSummary, extra: dict[str, str] | None = None) -> str:
    lines = [f"# {summary.title or 'Load report'}", ""]
    for key, value in (extra or {}).items():
        lines.append(f"- {key}: {value}")
    statuses = ", ".join(f"{k} {v}" for k, v in summary.statuses.items())
    lines += [
        f"- requests: {summary.requests} ({statuses})",
        f"- duration: {summary.duration_s:.2f} s",
        f"- throughput: {summary.request_throughput:.3f} req/s, {summary.output_token_throughput:.1f} output tok/s, "
        f"{summary.total_token_throughput:.1f} total tok/s",
        "",
        "| metric (ms) | P50 | P90 | P99 | mean | max | n |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: |",
        _row("TTFT", summary.ttft),
        _row("TPOT", summary.tpot),
        _row("E2E", summary.e2e),
    ]
    if summary.itl is not None:
        lines.append(_row("ITL", summary.itl))
    if summary.slo is not None:
        s = summary.slo
        limits = ", ".join(f"{name} <= {_ms(v)} ms" for name, v in
                           (("TTFT", s.slo.ttft_s), ("TPOT", s.slo.tpot_s), ("E2E", s.slo.e2e_s)) if v is not None)
        lines += ["", f"SLO ({limits}): attainment {_pct(s.attainment)} "
                      f"(TTFT {_pct(s.ttft_attainment)}, TPOT {_pct(s.tpot_attainment)}, E2E {_pct(s.e2e_attainment)})"]
    if len(summary.models) > 1:
        lines += ["", "| model | requests | done | TTFT P50 | TTFT P99 | TPOT P50 | TPOT P99 | SLO |",
                  "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
        for m in summary.models:
            t, p = m.ttft, m.tpot
            lines.append(f"| {m.model} | {m.requests} | {m.completed} | {_ms(t.p50) if t else '-'} | "
                         f"{_ms(t.p99) if t else '-'} | {_ms(p.p50) if p else '-'} | {_ms(p.p99) if p else '-'} | "
                         f"{_pct(m.slo_attainment)} |")
    return "\n".join(lines) + "\n"
