"""`tidal bench fidelity --default-cluster`: which workers ran the model's requests, read from the
workers' stats as the bus delivers them (tidal/bench/fidelity_default.py; the run itself needs a
loaded cluster for minutes and is documented in docs/running-real-models.md)."""
from __future__ import annotations

import asyncio

from shared.events import WorkerState, WorkerStats
from shared.events.common import LayerRange
from shared.events.worker import InstanceStats, PoolBreakdown
from tidal.bench.fidelity_default import ServingWatch


def stats(worker: str, ts: float, *loads: tuple[str, int, int]) -> WorkerStats:
    return WorkerStats(worker_id=worker, seq=1, ts=ts, device="cpu", state=WorkerState.READY,
                       pool=PoolBreakdown(capacity_bytes=1 << 20),
                       instances=[InstanceStats(instance_id=f"{worker}-{m}", model=m, layers=LayerRange(start=0, end=2),
                                                running=r, waiting=w) for m, r, w in loads])


def test_the_watch_names_the_workers_that_ran_the_model_and_from_when() -> None:
    watch = ServingWatch("m")
    feed = [stats("cpu-0", 99.0, ("m", 0, 0), ("other", 3, 0)), stats("cpu-1", 99.5, ("other", 0, 0))]
    for msg in feed:  # before the run: the instances serving at the start
        asyncio.run(watch._on_stats(msg, None))
    assert watch.at_start == {"cpu-0"}
    watch.t0_unix = 100.0
    for msg in [stats("cpu-0", 101.0, ("m", 2, 3)), stats("cpu-1", 102.0, ("other", 5, 0)),
                stats("cpu-1", 104.5, ("m", 1, 0)), stats("cpu-0", 105.0, ("m", 4, 0))]:
        asyncio.run(watch._on_stats(msg, None))
    assert watch.first == {"cpu-0": 1.0, "cpu-1": 4.5}  # the other model's requests do not count
    assert watch.peak == {"cpu-0": 5, "cpu-1": 1}
    assert watch.line() == "cpu-0 (from 1.0 s, peak 5), cpu-1 (from 4.5 s, peak 1)"
