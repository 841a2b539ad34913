"""The live view of `tidal bench serve`: a progress bar and a rich table of the run so far.

Redrawn from the runner's counters twice a second by an asyncio task (no refresh thread),
so the drawing costs the load client a few milliseconds per second at most.
"""
from __future__ import annotations

import asyncio
import time

import numpy as np
from rich.console import Console, Group
from rich.live import Live
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from loadgen.runner.runner import RunProgress


def _ms(values: list[float], q: float) -> str:
    return f"{np.percentile(values, q) * 1000:.1f}" if values else "-"


class LiveView:
    def __init__(self, progress: RunProgress, title: str, console: Console | None = None) -> None:
        self.state = progress
        self.title = title
        self.console = console or Console(stderr=True)
        self.bar = Progress(TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
                            TimeElapsedColumn(), console=self.console)
        self.task = self.bar.add_task("requests", total=None)
        self.live: Live | None = None

    def table(self) -> Table:
        s = self.state
        elapsed = max(time.perf_counter() - s.started, 1e-9) if s.started else 0.0
        t = Table(title=self.title, show_header=True, header_style="bold")
        for col in ("sent", "in flight", "done", "ok", "failed", "tok/s", "TTFT P50 ms", "TTFT P99 ms",
                    "TPOT P50 ms", "TPOT P99 ms"):
            t.add_column(col, justify="right")
        tps = f"{s.tokens / elapsed:.1f}" if elapsed > 0 else "-"
        t.add_row(str(s.sent), str(s.in_flight), str(s.done), str(s.ok), str(s.failed), tps,
                  _ms(s.recent_ttft_s, 50), _ms(s.recent_ttft_s, 99), _ms(s.recent_tpot_s, 50),
                  _ms(s.recent_tpot_s, 99))
        if s.last_error:
            t.caption = f"last error: {s.last_error[:120]}"
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
