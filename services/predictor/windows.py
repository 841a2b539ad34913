"""Dispatcher stats -> per-model load per window (pure: time is an argument, no I/O).

Window w is [w * window_s, (w + 1) * window_s) in Unix seconds, so seasons line up with UTC
days. A `DispatchStats` counts arrivals over (ts - interval_s, ts]; its arrivals go to the
window and the peak slot holding the interval's midpoint. A window is *observed* when at least
one dispatcher reported into it: a model absent from an observed window had no arrivals (0),
while a window nobody reported into (no dispatcher, or the predictor down) is missing (None).

    avg_rps  = arrivals in the window / window_s
    peak_rps = the most arrivals in one slot / slot_s     (slots: window_s split evenly, >= avg)

Arrivals are the dispatcher's admitted plus rejected requests of real models (the demand,
including what a full queue turned away; unknown model names are never counted).
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import msgspec
import numpy as np

from shared.events.dispatch import DispatchStats


class OpenWindows(msgspec.Struct, kw_only=True):
    """The windows still filling (what a restart must not lose): window -> model -> slot -> arrivals."""

    window_s: float
    slots: int
    closed_through: int | None = None  # the last window closed (later stats for it are late)
    windows: dict[int, dict[str, dict[int, int]]] = {}


class ModelHistory(msgspec.Struct, kw_only=True):
    """One model's closed windows: avg[k], peak[k] are window first_window + k (None: missing)."""

    model: str
    window_s: float
    first_window: int
    avg: list[float | None] = []
    peak: list[float | None] = []

    def next_window(self) -> int:
        return self.first_window + len(self.avg)

    def append(self, w: int, avg: float | None, peak: float | None, keep: int) -> None:
        """Record window w (after the last one; a gap is filled with missing windows), keep the last `keep`."""
        if self.avg and w < self.next_window():
            raise ValueError(f"{self.model}: window {w} is already recorded (next is {self.next_window()})")
        gap = w - self.next_window() if self.avg else 0
        if gap >= keep:  # everything recorded is older than the history keeps: start afresh
            self.avg, self.peak, gap = [], [], 0
        if not self.avg:
            self.first_window = w
        self.avg += [None] * gap + [avg]
        self.peak += [None] * gap + [peak]
        drop = len(self.avg) - keep
        if drop > 0:
            del self.avg[:drop], self.peak[:drop]
            self.first_window += drop


@dataclass(frozen=True)
class WindowLoad:
    avg_rps: float
    peak_rps: float


class WindowBook:
    """Accumulates stats into open windows and closes them once late stats can no longer come."""

    def __init__(self, window_s: float, slot_s: float, grace_s: float) -> None:
        if not window_s > 0 or not slot_s > 0 or grace_s < 0:
            raise ValueError(f"need window_s > 0, slot_s > 0, grace_s >= 0; got {window_s}, {slot_s}, {grace_s}")
        self.window_s = window_s
        self.slots = max(1, round(window_s / slot_s))
        self.slot_s = window_s / self.slots
        self.grace_s = grace_s
        self.state = OpenWindows(window_s=window_s, slots=self.slots)

    def restore(self, saved: OpenWindows) -> bool:
        """Adopt saved open windows; False (and nothing adopted) if they were cut differently."""
        if saved.window_s != self.window_s or saved.slots != self.slots:
            return False
        self.state = saved
        return True

    def window_of(self, ts: float) -> int:
        return math.floor(ts / self.window_s)

    def add(self, stats: DispatchStats, now: float) -> str | None:
        """Count one stats message; the reason it was skipped (late, future), or None."""
        mid = stats.ts - stats.interval_s / 2
        w = self.window_of(mid)
        closed = self.state.closed_through
        if closed is not None and w <= closed:
            return "late"
        if mid > now + self.window_s:
            return "future"
        slot = min(self.slots - 1, int((mid - w * self.window_s) // self.slot_s))
        window = self.state.windows.setdefault(w, {})
        for load in stats.models:
            arrivals = load.admitted + load.rejected
            if arrivals:
                per_slot = window.setdefault(load.model, {})
                per_slot[slot] = per_slot.get(slot, 0) + arrivals
        return None

    def due(self, now: float) -> range:
        """Windows to close now, oldest first: ended at least grace_s ago and not yet closed."""
        last_due = math.floor((now - self.grace_s) / self.window_s) - 1
        first = self.state.closed_through + 1 if self.state.closed_through is not None else None
        if first is None:  # first run: start at the oldest open window, or close nothing yet
            first = min(self.state.windows, default=last_due + 1)
        return range(first, last_due + 1)

    def close(self, w: int, models: set[str]) -> dict[str, WindowLoad] | None:
        """Close window w: each of `models` (and any seen in it) -> its load; None if w was not observed."""
        window = self.state.windows.pop(w, None)
        self.state.closed_through = w
        if window is None:
            return None
        out: dict[str, WindowLoad] = {}
        for model in sorted(models | set(window)):
            per_slot = window.get(model, {})
            avg = sum(per_slot.values()) / self.window_s
            peak = max(per_slot.values(), default=0) / self.slot_s
            out[model] = WindowLoad(avg_rps=avg, peak_rps=max(avg, peak))
        return out


def series_from_arrivals(times: Sequence[float], window_s: float, slot_s: float, windows: int,
                         ) -> tuple[list[float], list[float]]:
    """A trace's avg and peak rate per window (the live book's definitions), windows from t = 0."""
    slots = max(1, round(window_s / slot_s))
    slot_len = window_s / slots
    k = np.floor(np.asarray(times, dtype=np.float64) / slot_len).astype(np.int64)
    k = k[(k >= 0) & (k < windows * slots)]
    counts = np.bincount(k, minlength=windows * slots).reshape(windows, slots)
    avg = counts.sum(axis=1) / window_s
    peak = np.maximum(avg, counts.max(axis=1) / slot_len)
    return avg.tolist(), peak.tolist()


__all__ = ["ModelHistory", "OpenWindows", "WindowBook", "WindowLoad", "series_from_arrivals"]
