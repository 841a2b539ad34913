"""The unloaded baseline of a live run: some of the trace's requests, sent alone (or `parallel`
at a time, e.g. one per worker, so that workers sharing CPU cores step concurrently)."""
from __future__ import annotations

from collections.abc import Sequence
from urllib.parse import urlsplit

import msgspec

from loadgen.report.metrics import ReportSummary, summarize_records
from loadgen.runner.runner import LoadRunner, RunnerConfig
from loadgen.runner.stream import ConnectionPool
from loadgen.traces.schema import TraceRecord


async def live_unloaded_baseline(trace: Sequence[TraceRecord], config: RunnerConfig, context: dict[str, int],
                                 n: int = 10, parallel: int = 1) -> ReportSummary:
    """Up to n requests spread over the trace, `parallel` at a time, on warm keep-alive connections
    (one discarded warm-up first, so TCP connects are not in the numbers)."""
    split = urlsplit(config.url)
    pool = ConnectionPool(split.hostname or "127.0.0.1", split.port or 80)
    step = max(1, len(trace) // max(n, 1))
    picked = [msgspec.structs.replace(r, arrival_s=0.0) for r in list(trace)[::step][:n]]
    records = []
    try:
        await LoadRunner(picked[:parallel], config, context=context, pool=pool).run()  # warm-up
        for i in range(0, len(picked), parallel):
            outcome = await LoadRunner(picked[i:i + parallel], config, context=context, pool=pool).run()
            records += outcome.records
    finally:
        pool.close()
    return summarize_records(records, title="unloaded baseline", per_model=False)


__all__ = ["live_unloaded_baseline"]
