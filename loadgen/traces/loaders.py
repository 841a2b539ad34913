"""Loaders for the public trace files, for users who have them locally.

- BurstGPT (github.com/HPMLL/BurstGPT): `Timestamp,Model,Request tokens,Response tokens,
  Total tokens,Log Type`; Timestamp is seconds from the start of the trace. Rows with 0
  response tokens are failed requests and are skipped unless `keep_failed` (they are
  then kept with one output token).
- Azure LLM inference traces (github.com/Azure/AzurePublicDataset, 2023 and 2024):
  `TIMESTAMP,ContextTokens,GeneratedTokens`; TIMESTAMP is a date-time such as
  `2023-11-16 18:15:46.6805900`, made relative to the first row.

Both keep a window [start_s, start_s + duration_s) of the source, shift it to start at 0
and sort by arrival. Rows that do not parse raise an error naming the file and line.
"""
from __future__ import annotations

import csv
from collections.abc import Callable, Iterator, Mapping
from datetime import datetime, timezone
from pathlib import Path

import numpy as np

from loadgen.traces.build import make_trace
from loadgen.traces.schema import CsvImportParams, Trace

BURSTGPT_COLUMNS = ("Timestamp", "Model", "Request tokens", "Response tokens", "Total tokens", "Log Type")
AZURE_COLUMNS = ("TIMESTAMP", "ContextTokens", "GeneratedTokens")


class TraceCsvError(ValueError):
    pass


def _rows(path: Path, columns: tuple[str, ...]) -> Iterator[tuple[int, dict[str, str]]]:
    try:
        f = path.open(newline="", encoding="utf-8-sig")
    except OSError as exc:
        raise TraceCsvError(f"{path}: cannot read: {exc.strerror}") from None
    with f:
        reader = csv.DictReader(f)
        header = [h.strip() for h in reader.fieldnames or []]
        missing = [c for c in columns if c not in header]
        if missing:
            raise TraceCsvError(f"{path}: missing column(s) {', '.join(missing)}; header is {','.join(header)}")
        reader.fieldnames = header
        for line, row in enumerate(reader, start=2):
            yield line, row


def _parse(path: Path, line: int, what: str, value: str | None, conv: Callable[[str], float | int]):
    try:
        return conv((value or "").strip())
    except ValueError:
        raise TraceCsvError(f"{path}:{line}: bad {what} {value!r}") from None


def _utc_seconds(stamp: str) -> float:
    # naive stamps read as UTC: local time would add DST jumps
    return datetime.fromisoformat(stamp).replace(tzinfo=timezone.utc).timestamp()


def _window(params: CsvImportParams, times: list[float], models: list[str], prompts: list[int],
            outputs: list[int]) -> Trace:
    t = np.asarray(times, dtype=np.float64)
    t0 = float(t.min()) if len(t) else 0.0
    t = t - t0 - params.start_s
    keep = t >= 0
    if params.duration_s is not None:
        keep &= t < params.duration_s
    names = sorted(set(models))
    index = {m: i for i, m in enumerate(names)}
    model_idx = np.asarray([index[m] for m in models], dtype=np.int64)
    kept = int(keep.sum())
    duration = params.duration_s if params.duration_s is not None else (float(t[keep].max()) if kept else 0.0)
    final = CsvImportParams(source=params.source, format=params.format, rows_read=params.rows_read,
                            rows_kept=kept, start_s=params.start_s, duration_s=params.duration_s)
    return make_trace(final, duration, t[keep], names, model_idx[keep], np.asarray(prompts, np.int64)[keep],
                      np.asarray(outputs, np.int64)[keep])


# The segment KunServe's public code replays (its BurstGPT loader): 775 data rows from row 474438,
# timestamps divided by 10.
KUNSERVE_SEGMENT = {"offset_rows": 474_438, "count": 775, "time_divisor": 10.0}


def load_burstgpt_csv(path: str | Path, *, start_s: float = 0.0, duration_s: float | None = None,
                      model: str | None = None, model_map: Mapping[str, str] | None = None,
                      log_type: str | None = None, keep_failed: bool = False, offset_rows: int = 0,
                      count: int | None = None, time_divisor: float = 1.0) -> Trace:
    """`model` names every request's model; otherwise `model_map` renames the CSV's models.
    `offset_rows`/`count` take a slice of the data rows (0-based, before any filtering) and
    `time_divisor` compresses its timestamps, as KunServe's code does (`KUNSERVE_SEGMENT`)."""
    path = Path(path)
    if offset_rows < 0 or (count is not None and count < 1) or time_divisor <= 0:
        raise TraceCsvError(f"{path}: need offset_rows >= 0, count >= 1 and time_divisor > 0 "
                            f"(got {offset_rows}, {count}, {time_divisor})")
    times: list[float] = []
    models: list[str] = []
    prompts: list[int] = []
    outputs: list[int] = []
    rows = 0
    for index, (line, row) in enumerate(_rows(path, BURSTGPT_COLUMNS)):
        if index < offset_rows:
            continue
        if count is not None and index >= offset_rows + count:
            break
        rows += 1
        if log_type is not None and row["Log Type"].strip() != log_type:
            continue
        req = _parse(path, line, "Request tokens", row["Request tokens"], int)
        resp = _parse(path, line, "Response tokens", row["Response tokens"], int)
        if resp <= 0 and not keep_failed:
            continue
        times.append(_parse(path, line, "Timestamp", row["Timestamp"], float) / time_divisor)
        name = row["Model"].strip()
        models.append(model or (model_map or {}).get(name, name))
        prompts.append(max(1, req))
        outputs.append(max(1, resp))
    if offset_rows and not rows:
        raise TraceCsvError(f"{path}: no data rows at offset {offset_rows} (the file is shorter)")
    params = CsvImportParams(source=str(path), format="burstgpt", rows_read=rows, rows_kept=0,
                             start_s=start_s, duration_s=duration_s)
    return _window(params, times, models, prompts, outputs)


def load_azure_csv(path: str | Path, *, start_s: float = 0.0, duration_s: float | None = None,
                   model: str = "model-0") -> Trace:
    path = Path(path)
    times: list[float] = []
    prompts: list[int] = []
    outputs: list[int] = []
    rows = 0
    for line, row in _rows(path, AZURE_COLUMNS):
        rows += 1
        stamp = _parse(path, line, "TIMESTAMP", row["TIMESTAMP"], _utc_seconds)
        times.append(stamp)
        prompts.append(max(1, _parse(path, line, "ContextTokens", row["ContextTokens"], int)))
        outputs.append(max(1, _parse(path, line, "GeneratedTokens", row["GeneratedTokens"], int)))
    params = CsvImportParams(source=str(path), format="azure", rows_read=rows, rows_kept=0,
                             start_s=start_s, duration_s=duration_s)
    return _window(params, times, [model] * len(times), prompts, outputs)
