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

Concurrency (WarmServe's load: requests in the system) is sampled: every `WorkerStats` gives each
model's running + waiting requests on that worker, every `DispatchStats` its requests queued at
that dispatcher. A slot's concurrency is the sum over sources (workers, dispatchers) of each
source's mean over its samples in the slot (a source holding none of a model counts 0 for it);

    conc_avg  = the mean over the window's sampled slots,   conc_peak = their max

and a window with no sample has no concurrency (None).
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import msgspec
import numpy as np

from shared.events.dispatch import DispatchStats
from shared.events.worker import WorkerStats


class OpenWindows(msgspec.Struct, kw_only=True):
    """The windows still filling (what a restart must not lose): window -> model -> slot -> arrivals."""

    window_s: float
    slots: int
    closed_through: int | None = None  # the last window closed (later stats for it are late)
    windows: dict[int, dict[str, dict[int, int]]] = {}
    samples: dict[int, dict[int, dict[str, int]]] = {}  # window -> slot -> source -> concurrency samples
    in_system: dict[int, dict[str, dict[int, dict[str, int]]]] = {}  # window -> model -> slot -> source -> sum


class ModelHistory(msgspec.Struct, kw_only=True):
    """One model's closed windows: avg[k], peak[k] are window first_window + k (None: missing)."""

    model: str
    window_s: float
    first_window: int
    avg: list[float | None] = []
    peak: list[float | None] = []
    conc_avg: list[float | None] = []  # concurrency, aligned with avg (a history stored before it: padded)
    conc_peak: list[float | None] = []

    def next_window(self) -> int:
        return self.first_window + len(self.avg)

    def append(self, w: int, avg: float | None, peak: float | None, keep: int,
               conc: tuple[float, float] | None = None) -> None:
        """Record window w (after the last one; a gap is filled with missing windows), keep the last `keep`."""
        if self.avg and w < self.next_window():
            raise ValueError(f"{self.model}: window {w} is already recorded (next is {self.next_window()})")
        gap = w - self.next_window() if self.avg else 0
        if gap >= keep:  # everything recorded is older than the history keeps: start afresh
            self.avg, self.peak, gap = [], [], 0
        if not self.avg:
            self.first_window = w
        for series in ("conc_avg", "conc_peak"):
            held = getattr(self, series)[-len(self.avg):] if self.avg else []
            setattr(self, series, [None] * (len(self.avg) - len(held)) + held)
        self.avg += [None] * gap + [avg]
        self.peak += [None] * gap + [peak]
        self.conc_avg += [None] * gap + [None if conc is None else conc[0]]
        self.conc_peak += [None] * gap + [None if conc is None else conc[1]]
        drop = len(self.avg) - keep
        if drop > 0:
            del self.avg[:drop], self.peak[:drop], self.conc_avg[:drop], self.conc_peak[:drop]
            self.first_window += drop


@dataclass(frozen=True)
class WindowLoad:
    avg_rps: float | None  # None: no dispatcher reported into the window (only workers did)
    peak_rps: float | None
    concurrency: tuple[float, float] | None = None  # (avg, peak); None: no sample in the window


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

    def _place(self, ts: float, now: float) -> tuple[int, int] | str:
        """(window, slot) of time ts, or why it is skipped (late, future)."""
        w = self.window_of(ts)
        closed = self.state.closed_through
        if closed is not None and w <= closed:
            return "late"
        if ts > now + self.window_s:
            return "future"
        return w, min(self.slots - 1, int((ts - w * self.window_s) // self.slot_s))

    def add(self, stats: DispatchStats, now: float) -> str | None:
        """Count one stats message; the reason it was skipped (late, future), or None."""
        placed = self._place(stats.ts - stats.interval_s / 2, now)
        if isinstance(placed, str):
            return placed
        w, slot = placed
        window = self.state.windows.setdefault(w, {})
        queued: dict[str, int] = {}
        for load in stats.models:
            arrivals = load.admitted + load.rejected
            if arrivals:
                per_slot = window.setdefault(load.model, {})
                per_slot[slot] = per_slot.get(slot, 0) + arrivals
            queued[load.model] = queued.get(load.model, 0) + load.queued
        at = self._place(stats.ts, now)  # the queue is a sample at the interval's end
        if not isinstance(at, str):
            self._sample(at, f"d:{stats.dispatcher_id}", queued)
        return None

    def add_worker(self, stats: WorkerStats, now: float) -> str | None:
        """Sample one worker's requests in the system per model; the reason it was skipped, or None."""
        placed = self._place(stats.ts, now)
        if isinstance(placed, str):
            return placed
        counts: dict[str, int] = {}
        for inst in stats.instances:
            counts[inst.model] = counts.get(inst.model, 0) + inst.running + inst.waiting
        self._sample(placed, f"w:{stats.worker_id}", counts)
        return None

    def _sample(self, at: tuple[int, int], source: str, counts: dict[str, int]) -> None:
        w, slot = at
        per_source = self.state.samples.setdefault(w, {}).setdefault(slot, {})
        per_source[source] = per_source.get(source, 0) + 1
        window = self.state.in_system.setdefault(w, {})
        for model, n in counts.items():
            if n:
                sums = window.setdefault(model, {}).setdefault(slot, {})
                sums[source] = sums.get(source, 0) + n

    def due(self, now: float) -> range:
        """Windows to close now, oldest first: ended at least grace_s ago and not yet closed."""
        last_due = math.floor((now - self.grace_s) / self.window_s) - 1
        first = self.state.closed_through + 1 if self.state.closed_through is not None else None
        if first is None:  # first run: start at the oldest open window, or close nothing yet
            first = min([*self.state.windows, *self.state.samples], default=last_due + 1)
        return range(first, last_due + 1)

    def close(self, w: int, models: set[str]) -> dict[str, WindowLoad] | None:
        """Close window w: each of `models` (and any seen in it) -> its load; None if nobody reported into w."""
        window = self.state.windows.pop(w, None)
        samples = self.state.samples.pop(w, None)
        in_system = self.state.in_system.pop(w, {})
        self.state.closed_through = w
        if window is None and samples is None:
            return None
        out: dict[str, WindowLoad] = {}
        for model in sorted(models | set(window or {}) | set(in_system)):
            conc = _concurrency(samples, in_system.get(model, {})) if samples else None
            if window is None:
                out[model] = WindowLoad(avg_rps=None, peak_rps=None, concurrency=conc)
                continue
            per_slot = window.get(model, {})
            avg = sum(per_slot.values()) / self.window_s
            peak = max(per_slot.values(), default=0) / self.slot_s
            out[model] = WindowLoad(avg_rps=avg, peak_rps=max(avg, peak), concurrency=conc)
        return out


def _concurrency(samples: dict[int, dict[str, int]], sums: dict[int, dict[str, int]]) -> tuple[float, float]:
    """(mean, max) over the sampled slots of the sum over sources of each source's mean in the slot."""
    per_slot = [sum(n / counts[src] for src, n in sums.get(slot, {}).items() if counts.get(src))
                for slot, counts in samples.items()]
    return sum(per_slot) / len(per_slot), max(per_slot)


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
