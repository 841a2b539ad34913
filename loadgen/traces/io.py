"""Read and write trace files (JSONL: a `TraceHeader` line, then `TraceRecord` lines)."""
from __future__ import annotations

from pathlib import Path

import msgspec

from loadgen.traces.schema import TRACE_FORMAT_VERSION, Trace, TraceHeader, TraceRecord

_encoder = msgspec.json.Encoder()
_header_decoder = msgspec.json.Decoder(TraceHeader)
_record_decoder = msgspec.json.Decoder(TraceRecord)


class TraceFormatError(ValueError):
    """A trace file that does not follow the schema; the message names file and line."""


def write_trace(path: str | Path, trace: Trace) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("wb") as f:
        f.write(_encoder.encode(trace.header))
        f.write(b"\n")
        f.write(_encoder.encode_lines(trace.records))
    return path


def read_trace(path: str | Path) -> Trace:
    path = Path(path)
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise TraceFormatError(f"{path}: cannot read trace: {exc.strerror}") from None
    first, _, rest = data.partition(b"\n")
    try:
        header = _header_decoder.decode(first)
    except msgspec.DecodeError as exc:
        raise TraceFormatError(f"{path}:1: not a tidal trace header ({exc})") from None
    if header.tidal_trace != TRACE_FORMAT_VERSION:
        raise TraceFormatError(f"{path}:1: trace format {header.tidal_trace}, this tidal reads {TRACE_FORMAT_VERSION}")
    try:
        records = _record_decoder.decode_lines(rest)
    except msgspec.DecodeError:
        records = _decode_line_by_line(path, rest)  # slow path, only to name the bad line
    _check_order(path, records)
    return Trace(header=header, records=records)


def _decode_line_by_line(path: Path, rest: bytes) -> list[TraceRecord]:
    records = []
    for i, line in enumerate(rest.split(b"\n"), start=2):
        if not line.strip():
            continue
        try:
            records.append(_record_decoder.decode(line))
        except msgspec.DecodeError as exc:
            raise TraceFormatError(f"{path}:{i}: bad trace record: {exc}") from None
    return records


def _check_order(path: Path, records: list[TraceRecord]) -> None:
    last = float("-inf")
    for i, r in enumerate(records, start=2):
        if r.arrival_s < last:
            raise TraceFormatError(f"{path}:{i}: arrival_s {r.arrival_s} is before the previous record's {last}")
        if r.prompt_tokens < 1 or r.output_tokens < 1:
            raise TraceFormatError(f"{path}:{i}: prompt_tokens and output_tokens must be >= 1")
        last = r.arrival_s


def scale_time(trace: Trace, factor: float) -> Trace:
    """Compress time by `factor` (2.0 = twice the rate, half the duration)."""
    if not factor > 0:
        raise ValueError(f"time scale must be > 0, got {factor}")
    records = [msgspec.structs.replace(r, arrival_s=round(r.arrival_s / factor, 6)) for r in trace.records]
    header = msgspec.structs.replace(
        trace.header, duration_s=trace.header.duration_s / factor, time_scale=trace.header.time_scale * factor
    )
    return Trace(header=header, records=records)
