"""Latency percentiles, SLO attainment and throughput from request records.

TTFT = first token - arrival; TPOT = (finish - first token) / (output tokens - 1), per
request with at least two tokens; E2E = finish - arrival; ITL = gaps between consecutive
tokens (only where records carry token times). Percentiles are over successful
requests. SLO attainment is over *all* requests: a failed request misses every SLO.
Throughput divides by the run's span, first arrival to last finish.
"""
from __future__ import annotations

import msgspec
import numpy as np

from loadgen.report.records import RequestRecord


class LatencyStats(msgspec.Struct, frozen=True, kw_only=True):
    count: int
    mean: float
    p50: float
    p90: float
    p99: float
    max: float


class SloSpec(msgspec.Struct, frozen=True, kw_only=True):
    """Thresholds in seconds; None = not checked."""

    ttft_s: float | None = None
    tpot_s: float | None = None
    e2e_s: float | None = None

    @classmethod
    def scaled(cls, k: float, baseline: "ReportSummary") -> "SloSpec":
        """k x the P50 TTFT and TPOT of a baseline (unloaded) run; KunServe uses k = 5."""
        return cls(ttft_s=k * baseline.ttft.p50 if baseline.ttft else None,
                   tpot_s=k * baseline.tpot.p50 if baseline.tpot else None)


class SloResult(msgspec.Struct, frozen=True, kw_only=True):
    slo: SloSpec
    attainment: float  # share of all requests meeting every given SLO
    ttft_attainment: float | None = None
    tpot_attainment: float | None = None
    e2e_attainment: float | None = None


class ModelSummary(msgspec.Struct, frozen=True, kw_only=True):
    model: str
    requests: int
    completed: int
    ttft: LatencyStats | None
    tpot: LatencyStats | None
    e2e: LatencyStats | None
    slo_attainment: float | None = None


class ReportSummary(msgspec.Struct, frozen=True, kw_only=True):
    title: str = ""
    requests: int
    completed: int
    statuses: dict[str, int]
    duration_s: float
    request_throughput: float  # completed requests per second
    output_token_throughput: float  # generated tokens per second
    total_token_throughput: float  # prompt + generated tokens per second
    ttft: LatencyStats | None
    tpot: LatencyStats | None
    e2e: LatencyStats | None
    itl: LatencyStats | None = None
    slo: SloResult | None = None
    models: list[ModelSummary] = []


class Columns:
    """Records as numpy columns (NaN where a value is missing)."""

    def __init__(self, records: list[RequestRecord]) -> None:
        n = len(records)
        nan = float("nan")
        self.arrival = np.fromiter((r.arrival_s for r in records), np.float64, n)
        self.first = np.fromiter((nan if r.first_token_s is None else r.first_token_s for r in records), np.float64, n)
        self.finish = np.fromiter((nan if r.finish_s is None else r.finish_s for r in records), np.float64, n)
        self.prompt = np.fromiter((r.prompt_tokens for r in records), np.int64, n)
        self.output = np.fromiter((r.output_tokens for r in records), np.int64, n)
        self.ok = np.fromiter((r.status == "ok" for r in records), bool, n)
        self.ttft = self.first - self.arrival
        self.e2e = self.finish - self.arrival
        with np.errstate(invalid="ignore", divide="ignore"):
            self.tpot = np.where(self.output >= 2, (self.finish - self.first) / (self.output - 1), np.nan)


def latency_stats(values: np.ndarray) -> LatencyStats | None:
    values = values[~np.isnan(values)]
    if len(values) == 0:
        return None
    p50, p90, p99 = np.percentile(values, [50, 90, 99]).tolist()
    return LatencyStats(count=len(values), mean=float(values.mean()), p50=p50, p90=p90, p99=p99,
                        max=float(values.max()))


def _meets(values: np.ndarray, ok: np.ndarray, limit: float, missing_ok: bool = False) -> np.ndarray:
    with np.errstate(invalid="ignore"):
        met = values <= limit
    if missing_ok:
        met |= np.isnan(values)
    return met & ok


def slo_attainment(cols: Columns, slo: SloSpec) -> SloResult:
    n = max(len(cols.ok), 1)
    every = cols.ok.copy()
    parts: dict[str, float | None] = {"ttft": None, "tpot": None, "e2e": None}
    for name, values, limit, missing_ok in (("ttft", cols.ttft, slo.ttft_s, False),
                                            ("tpot", cols.tpot, slo.tpot_s, True),  # one token: no TPOT to miss
                                            ("e2e", cols.e2e, slo.e2e_s, False)):
        if limit is None:
            continue
        met = _meets(values, cols.ok, limit, missing_ok)
        parts[name] = float(met.sum()) / n
        every &= met
    return SloResult(slo=slo, attainment=float(every.sum()) / n, ttft_attainment=parts["ttft"],
                     tpot_attainment=parts["tpot"], e2e_attainment=parts["e2e"])


def _itl(records: list[RequestRecord]) -> LatencyStats | None:
    gaps = [np.diff(r.token_times_s) for r in records if r.status == "ok" and r.token_times_s and len(r.token_times_s) > 1]
    return latency_stats(np.concatenate(gaps)) if gaps else None


def summarize_records(records: list[RequestRecord], *, slo: SloSpec | None = None, title: str = "",
                      per_model: bool = True) -> ReportSummary:
    cols = Columns(records)
    ok = cols.ok
    statuses: dict[str, int] = {}
    for r in records:
        statuses[r.status] = statuses.get(r.status, 0) + 1
    ends = cols.finish[~np.isnan(cols.finish)]
    duration = float(ends.max() - cols.arrival.min()) if len(ends) else 0.0
    per_s = (1.0 / duration) if duration > 0 else 0.0
    models: list[ModelSummary] = []
    if per_model:
        names = np.array([r.model for r in records])
        for name in sorted(set(names.tolist())):
            sel = names == name
            sub = _subset(cols, sel)
            models.append(ModelSummary(
                model=name, requests=int(sel.sum()), completed=int(sub.ok.sum()),
                ttft=latency_stats(sub.ttft[sub.ok]), tpot=latency_stats(sub.tpot[sub.ok]),
                e2e=latency_stats(sub.e2e[sub.ok]),
                slo_attainment=slo_attainment(sub, slo).attainment if slo else None))
    return ReportSummary(
        title=title, requests=len(records), completed=int(ok.sum()), statuses=dict(sorted(statuses.items())),
        duration_s=duration, request_throughput=float(ok.sum()) * per_s,
        output_token_throughput=float(cols.output[ok].sum()) * per_s,
        total_token_throughput=float((cols.output[ok] + cols.prompt[ok]).sum()) * per_s,
        ttft=latency_stats(cols.ttft[ok]), tpot=latency_stats(cols.tpot[ok]), e2e=latency_stats(cols.e2e[ok]),
        itl=_itl(records), slo=slo_attainment(cols, slo) if slo else None, models=models)


def _subset(cols: Columns, sel: np.ndarray) -> Columns:
    sub = Columns.__new__(Columns)
    for name, value in vars(cols).items():
        setattr(sub, name, value[sel])
    return sub
