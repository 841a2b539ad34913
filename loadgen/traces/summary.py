"""Summary statistics of a trace (what `tidal trace info` prints and the tests check)."""
from __future__ import annotations

from collections import Counter

import msgspec
import numpy as np

from loadgen.traces.schema import Trace


class LengthSummary(msgspec.Struct, frozen=True):
    mean: float
    p50: float
    p80: float
    p95: float
    p99: float


class TraceSummary(msgspec.Struct, frozen=True):
    requests: int
    duration_s: float
    mean_rate: float  # requests per second over the header's duration
    peak_rate_1s: float  # most requests in any one-second bin
    models: dict[str, int]  # requests per model
    adapters: int  # distinct adapters used
    prompt: LengthSummary
    output: LengthSummary


def _lengths(values: np.ndarray) -> LengthSummary:
    if len(values) == 0:
        return LengthSummary(0, 0, 0, 0, 0)
    p50, p80, p95, p99 = np.percentile(values, [50, 80, 95, 99]).tolist()
    return LengthSummary(float(values.mean()), p50, p80, p95, p99)


def summarize(trace: Trace) -> TraceSummary:
    recs = trace.records
    times = np.fromiter((r.arrival_s for r in recs), np.float64, len(recs))
    duration = trace.header.duration_s or (float(times.max()) if len(times) else 0.0)
    peak = int(np.bincount(times.astype(np.int64)).max()) if len(times) else 0
    return TraceSummary(
        requests=len(recs),
        duration_s=duration,
        mean_rate=len(recs) / duration if duration > 0 else 0.0,
        peak_rate_1s=float(peak),
        models=dict(sorted(Counter(r.model for r in recs).items())),
        adapters=len({r.adapter for r in recs if r.adapter is not None}),
        prompt=_lengths(np.fromiter((r.prompt_tokens for r in recs), np.float64, len(recs))),
        output=_lengths(np.fromiter((r.output_tokens for r in recs), np.float64, len(recs))),
    )


def format_summary(s: TraceSummary) -> str:
    lines = [
        f"requests      {s.requests}",
        f"duration      {s.duration_s:.1f} s",
        f"mean rate     {s.mean_rate:.3f} req/s (peak {s.peak_rate_1s:.0f} in one second)",
        f"adapters      {s.adapters}",
        "              mean     p50     p80     p95     p99",
    ]
    for name, ls in (("prompt", s.prompt), ("output", s.output)):
        lines.append(f"{name:<10}{ls.mean:8.1f}{ls.p50:8.0f}{ls.p80:8.0f}{ls.p95:8.0f}{ls.p99:8.0f}")
    lines.append("models        " + ", ".join(f"{m}: {n}" for m, n in s.models.items()))
    return "\n".join(lines)
