"""Per-request records (what a live runner or the simulator writes) and optional overlays.

All times are seconds on one clock (a run's start is 0 by convention). A record has
`token_times_s` when the runner saw each streamed chunk; the simulator leaves it out and the
report then derives TPOT from first token and finish alone.
"""
from __future__ import annotations

from pathlib import Path
from typing import Literal

import msgspec

RequestStatus = Literal["ok", "error", "rejected", "aborted", "timeout"]


class RequestRecord(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    request_id: str
    model: str
    arrival_s: float  # when the request was sent (open loop: its trace arrival time)
    prompt_tokens: int
    output_tokens: int  # tokens actually received
    status: RequestStatus = "ok"
    first_token_s: float | None = None
    finish_s: float | None = None  # last token (or the error) received
    token_times_s: list[float] | None = None  # when each streamed chunk arrived (first token first; later chunks may carry several tokens: `stream_interval`)
    adapter: str | None = None
    worker: str | None = None
    error: str | None = None

    @property
    def ttft_s(self) -> float | None:
        return None if self.first_token_s is None else self.first_token_s - self.arrival_s

    @property
    def e2e_s(self) -> float | None:
        return None if self.finish_s is None else self.finish_s - self.arrival_s

    @property
    def tpot_s(self) -> float | None:
        """Mean time per output token after the first (vLLM's TPOT); None below two tokens."""
        if self.first_token_s is None or self.finish_s is None or self.output_tokens < 2:
            return None
        return (self.finish_s - self.first_token_s) / (self.output_tokens - 1)


class MemorySample(msgspec.Struct, frozen=True, kw_only=True):
    """Bytes of one kind (a `shared.events.worker.MemoryKind` value: weights, prewarm,
    adapter, kv, workspace) held on one worker at time t_s."""

    t_s: float
    worker: str
    kind: str
    bytes: int


class PlanMarker(msgspec.Struct, frozen=True, kw_only=True):
    """A cluster plan event (decided, applied, ...) drawn on the timeline."""

    t_s: float
    label: str


_encoder = msgspec.json.Encoder()


def write_records(path: str | Path, records: list[RequestRecord]) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(_encoder.encode_lines(records))
    return path


def read_records(path: str | Path) -> list[RequestRecord]:
    path = Path(path)
    try:
        return msgspec.json.Decoder(RequestRecord).decode_lines(path.read_bytes())
    except msgspec.DecodeError as exc:
        raise ValueError(f"{path}: not a request-record file: {exc}") from None
