"""The live view of `tidal bench serve`: a progress bar and a rich table of the run so far.

Redrawn from the runner's counters twice a second by an asyncio task (no refresh thread),
so the drawing costs the load client a few milliseconds per second at most. It counts what
streams receive while they run, not only finished requests: in flight (sent, not ended),
streaming (of those, the ones that have a token), tokens/s streamed over the last
`RATE_WINDOW_S` (token events of running streams, exact counts of finished ones) and TTFT from
every first token, so a long run under load shows progress before its first request ends.
"""
from __future__ import annotations

import asyncio
import time
from collections import deque

import numpy as np
from rich.console import Console, Group
from rich.live import Live
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from loadgen.runner.runner import RunProgress


RATE_WINDOW_S = 5.0
COLUMNS = ("sent", "in flight", "streaming", "done", "ok", "failed", "tok/s", "TTFT ms P50/P99",
           "TPOT ms P50/P99")  # headers wrap at their spaces: the table fits 80 columns


def _ms(values: list[float], q: float) -> str:
    if not values:
        return "-"
    ms = float(np.percentile(values, q)) * 1000
    return f"{ms:.1f}" if ms < 100 else f"{ms:.0f}"


def _p50_p99(values: list[float]) -> str:
    return "-" if not values else f"{_ms(values, 50)}/{_ms(values, 99)}"


class RecentRate:
    """A counter's rate over the last `window_s` seconds, from the samples it is given."""

    def __init__(self, window_s: float = RATE_WINDOW_S) -> None:
        self.window_s = window_s
        self.samples: deque[tuple[float, int]] = deque()

    def add(self, now: float, total: int) -> float | None:
        self.samples.append((now, total))
        while len(self.samples) > 2 and now - self.samples[1][0] >= self.window_s:
            self.samples.popleft()
        (t0, n0), (t1, n1) = self.samples[0], self.samples[-1]
        return max(0.0, (n1 - n0) / (t1 - t0)) if t1 > t0 else None


class LiveView:
    def __init__(self, progress: RunProgress, title: str, console: Console | None = None) -> None:
        self.state = progress
        self.title = title
        self.console = console or Console(stderr=True)
        self.bar = Progress(TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
                            TimeElapsedColumn(), console=self.console)
        self.task = self.bar.add_task("requests", total=None)
        self.live: Live | None = None
        self.rate = RecentRate()

    def row(self, now: float | None = None) -> dict[str, str]:
        """The table's cells by column (what a test reads)."""
        s = self.state
        rate = self.rate.add(time.perf_counter() if now is None else now, s.streamed_tokens)
        ttft = s.streams.first_token_s
        cells = (s.sent, s.in_flight, s.streams.streaming, s.done, s.ok, s.failed,
                 "-" if rate is None else f"{rate:.1f}", _p50_p99(ttft), _p50_p99(s.recent_tpot_s))
        return dict(zip(COLUMNS, map(str, cells)))

    def table(self) -> Table:
        s = self.state
        t = Table(title=self.title + (" (stopping: waiting for running streams)" if s.stopping else ""),
                  show_header=True, header_style="bold", box=None, padding=(0, 1), pad_edge=False)
        row = self.row()
        for col, value in row.items():  # as wide as its value or its longest header word: headers wrap
            t.add_column(col, justify="right", width=max(len(value), *(len(w) for w in col.split())))
        t.add_row(*row.values())
        t.caption = f"tok/s: streamed over the last {RATE_WINDOW_S:.0f} s; TTFT: every first token, running streams too"
        if s.last_error:
            t.caption += f"\nlast error: {s.last_error[:120]}"
        return t

    def render(self) -> Group:
        self.bar.update(self.task, total=self.state.total or None, completed=self.state.done)
        return Group(self.bar, self.table())

    async def run(self, interval_s: float = 0.5) -> None:
        with Live(self.render(), console=self.console, auto_refresh=False, transient=False) as live:
            self.live = live
            try:
                while True:
                    await asyncio.sleep(interval_s)
                    live.update(self.render(), refresh=True)
            finally:
                live.update(self.render(), refresh=True)


__all__ = ["LiveView"]
