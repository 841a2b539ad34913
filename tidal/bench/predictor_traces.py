"""Requests per model (arrivals, and lengths where recorded) from a user's trace file, for `tidal bench predictor`.

Accepted: the project's trace format (JSONL, `tidal trace ...`), the public Azure LLM inference
CSV (`TIMESTAMP,ContextTokens,GeneratedTokens`), the BurstGPT CSV, or a plain CSV whose first
column is a timestamp (seconds, or a date-time such as 2023-11-16 18:15:46) and whose optional
second column names the model; a header line is allowed (no lengths: the bench holds each request
for a fixed time). Times are made relative to the first.
"""
from __future__ import annotations

import csv
from datetime import datetime, timezone
from pathlib import Path

import numpy as np

from loadgen.traces.io import read_trace
from loadgen.traces.loaders import AZURE_COLUMNS, BURSTGPT_COLUMNS, load_azure_csv, load_burstgpt_csv
from loadgen.traces.schema import Trace
from tidal.bench.predictor_series import ModelRequests


def read_arrivals(path: str | Path) -> tuple[dict[str, np.ndarray], float]:
    """(model -> sorted arrival seconds from the trace's start, the trace's duration in seconds)."""
    per, span = read_requests(path)
    return {m: r.arrivals for m, r in per.items()}, span


def read_requests(path: str | Path) -> tuple[dict[str, ModelRequests], float]:
    """(model -> its requests, arrivals sorted from the trace's start; the trace's duration in seconds)."""
    path = Path(path)
    try:
        with path.open("r", encoding="utf-8-sig", errors="replace") as f:
            first = f.readline()
    except OSError as exc:
        raise SystemExit(f"error: {path}: cannot read: {exc.strerror}") from None
    if '"tidal_trace"' in first:
        return _from_trace(read_trace(path))
    header = [h.strip() for h in first.split(",")]
    if all(c in header for c in AZURE_COLUMNS):
        return _from_trace(load_azure_csv(path))
    if all(c in header for c in BURSTGPT_COLUMNS):
        return _from_trace(load_burstgpt_csv(path))
    return _from_plain_csv(path)


def _from_trace(trace: Trace) -> tuple[dict[str, ModelRequests], float]:
    per: dict[str, list[tuple[float, int, int]]] = {}
    for r in trace.records:
        per.setdefault(r.model, []).append((r.arrival_s, r.prompt_tokens, r.output_tokens))
    last = max((r.arrival_s for r in trace.records), default=0.0)
    out = {}
    for model, rows in per.items():
        cols = np.asarray(sorted(rows), dtype=np.float64)
        out[model] = ModelRequests(cols[:, 0], cols[:, 1], cols[:, 2])
    return out, max(trace.header.duration_s, last)


def _stamp(value: str) -> float:
    try:
        return float(value)
    except ValueError:
        return datetime.fromisoformat(value).replace(tzinfo=timezone.utc).timestamp()


def _from_plain_csv(path: Path) -> tuple[dict[str, ModelRequests], float]:
    per: dict[str, list[float]] = {}
    with path.open(newline="", encoding="utf-8-sig") as f:
        for line, row in enumerate(csv.reader(f), start=1):
            if not row or not row[0].strip():
                continue
            try:
                t = _stamp(row[0].strip())
            except ValueError:
                if line == 1:
                    continue  # a header
                raise SystemExit(f"error: {path}:{line}: bad timestamp {row[0]!r} (seconds or a date-time)") from None
            model = row[1].strip() if len(row) > 1 and row[1].strip() else "model-0"
            per.setdefault(model, []).append(t)
    if not per:
        raise SystemExit(f"error: {path}: no timestamps found")
    start = min(min(t) for t in per.values())
    end = max(max(t) for t in per.values())
    return {m: ModelRequests(np.sort(np.asarray(t) - start)) for m, t in per.items()}, end - start
