"""Concurrency per window from worker stats and dispatcher queues (services/predictor/windows.py, pure)."""
from __future__ import annotations

import msgspec
import pytest

from services.predictor.windows import ModelHistory, OpenWindows, WindowBook
from shared.events.dispatch import DispatchStats, ModelLoad
from shared.events.worker import InstanceStats, LayerRange, PoolBreakdown, WorkerState, WorkerStats


def worker(wid: str, ts: float, **in_system: tuple[int, int]) -> WorkerStats:
    return WorkerStats(worker_id=wid, seq=0, ts=ts, device="cpu", state=WorkerState.READY,
                       pool=PoolBreakdown(capacity_bytes=1 << 20),
                       instances=[InstanceStats(instance_id=f"{wid}-{m}", model=m, layers=LayerRange(start=0, end=2),
                                                running=r, waiting=q) for m, (r, q) in in_system.items()])


def queue(ts: float, **queued: int) -> DispatchStats:
    return DispatchStats(dispatcher_id="d1", ts=ts, interval_s=1.0,
                         models=[ModelLoad(model=m, queued=n) for m, n in queued.items()])


def test_each_source_counts_its_mean_in_the_slot_and_the_window_its_slots():
    book = WindowBook(window_s=10.0, slot_s=5.0, grace_s=0.0)
    # slot [100, 105): w1 samples a = 2 then 4 (mean 3), w2 samples a = 1 once; the dispatcher queues 2 of a
    assert book.add_worker(worker("w1", 101.0, a=(2, 0)), now=101.0) is None
    book.add_worker(worker("w1", 102.0, a=(3, 1)), now=102.0)
    book.add_worker(worker("w2", 103.0, a=(1, 0), b=(5, 0)), now=103.0)
    book.add(queue(104.0, a=2), now=104.0)
    # slot [105, 110): w1 holds none of a (counts 0), w2 holds a = 1
    book.add_worker(worker("w1", 106.0), now=106.0)
    book.add_worker(worker("w2", 107.0, a=(1, 0)), now=107.0)
    loads = book.close(10, {"a", "b", "c"})
    assert loads is not None
    assert loads["a"].concurrency == pytest.approx(((3 + 1 + 2 + 1) / 2, 3 + 1 + 2))
    assert loads["b"].concurrency == pytest.approx((5 / 2, 5))
    assert loads["c"].concurrency == (0.0, 0.0)  # sampled, none in the system
    assert loads["a"].avg_rps == 0.0  # a dispatcher reported into the window: the rate is observed


def test_a_window_only_workers_reported_into_has_concurrency_and_no_rate():
    book = WindowBook(window_s=10.0, slot_s=5.0, grace_s=0.0)
    book.add_worker(worker("w1", 101.0, a=(2, 0)), now=101.0)
    assert list(book.due(119.0)) == [10]
    loads = book.close(10, {"a"})
    assert loads is not None and loads["a"].avg_rps is None and loads["a"].concurrency == (2.0, 2.0)
    assert book.add_worker(worker("w1", 101.0, a=(2, 0)), now=121.0) == "late"
    assert book.add_worker(worker("w1", 1000.0, a=(2, 0)), now=121.0) == "future"


def test_samples_survive_a_round_trip_of_the_open_windows():
    book = WindowBook(window_s=10.0, slot_s=5.0, grace_s=0.0)
    book.add_worker(worker("w1", 101.0, a=(2, 1)), now=101.0)
    saved = msgspec.msgpack.decode(msgspec.msgpack.encode(book.state), type=OpenWindows)
    again = WindowBook(window_s=10.0, slot_s=5.0, grace_s=0.0)
    assert again.restore(saved)
    assert again.close(10, set())["a"].concurrency == (3.0, 3.0)  # type: ignore[index]


def test_history_keeps_concurrency_aligned_even_from_an_older_record():
    older = msgspec.msgpack.encode({"model": "a", "window_s": 60.0, "first_window": 5, "avg": [1.0, 2.0],
                                    "peak": [1.0, 2.0]})  # stored before concurrency was recorded
    h = msgspec.msgpack.decode(older, type=ModelHistory)
    h.append(7, 3.0, 3.0, keep=3, conc=(4.0, 6.0))
    assert (h.first_window, h.avg, h.conc_avg, h.conc_peak) == (5, [1.0, 2.0, 3.0], [None, None, 4.0],
                                                                [None, None, 6.0])
    h.append(9, None, None, keep=3)
    assert (h.first_window, h.avg, h.conc_avg) == (7, [3.0, None, None], [4.0, None, None])
