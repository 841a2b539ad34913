"""Dispatcher stats -> per-model avg / peak rate per window, and the stored history (pure)."""
from __future__ import annotations

import msgspec
import pytest

from services.predictor.windows import ModelHistory, OpenWindows, WindowBook, series_from_arrivals
from shared.events.dispatch import DispatchStats, ModelLoad


def stats(ts: float, interval: float = 1.0, **arrivals: int) -> DispatchStats:
    return DispatchStats(dispatcher_id="d1", ts=ts, interval_s=interval,
                         models=[ModelLoad(model=m, arrivals=n, admitted=n - n // 4, rejected=n // 4)
                                 for m, n in arrivals.items()])


def test_avg_is_arrivals_over_the_window_and_peak_the_busiest_slot():
    book = WindowBook(window_s=10.0, slot_s=2.0, grace_s=1.0)
    for t, n in [(101.0, 4), (102.0, 4), (105.0, 12), (110.0, 2)]:  # midpoints 100.5, 101.5, 104.5, 109.5
        assert book.add(stats(t, a=n), now=t) is None
    assert list(book.due(110.9)) == [] and list(book.due(111.0)) == [10]
    loads = book.close(10, {"a", "b"})
    assert loads is not None
    assert loads["a"].avg_rps == pytest.approx(22 / 10)
    assert loads["a"].peak_rps == pytest.approx(12 / 2)  # slot [104, 106)
    assert loads["b"].avg_rps == 0 and loads["b"].peak_rps == 0  # known, silent in an observed window


def test_unobserved_windows_are_missing_and_late_stats_skipped():
    book = WindowBook(window_s=10.0, slot_s=5.0, grace_s=0.0)
    book.add(stats(101.0, a=3), now=101.0)
    assert list(book.due(130.0)) == [10, 11, 12]
    assert book.close(10, {"a"}) is not None
    assert book.close(11, {"a"}) is None  # nobody reported into [110, 120)
    assert book.add(stats(104.0, a=1), now=131.0) == "late"
    assert book.add(stats(1000.0, a=1), now=131.0) == "future"


def test_open_windows_survive_a_round_trip_and_a_different_cut_is_refused():
    book = WindowBook(window_s=10.0, slot_s=5.0, grace_s=0.0)
    book.add(stats(101.0, a=3), now=101.0)
    saved = msgspec.msgpack.decode(msgspec.msgpack.encode(book.state), type=OpenWindows)
    again = WindowBook(window_s=10.0, slot_s=5.0, grace_s=0.0)
    assert again.restore(saved)
    assert again.close(10, set())["a"].avg_rps == pytest.approx(0.3)  # type: ignore[index]
    assert not WindowBook(window_s=20.0, slot_s=5.0, grace_s=0.0).restore(saved)


def test_history_fills_gaps_with_missing_and_keeps_the_last_windows():
    h = ModelHistory(model="a", window_s=60.0, first_window=0)
    h.append(100, 1.0, 2.0, keep=5)
    h.append(103, 3.0, 4.0, keep=5)
    assert (h.first_window, h.avg) == (100, [1.0, None, None, 3.0])
    h.append(104, 5.0, 5.0, keep=3)
    assert (h.first_window, h.avg, h.peak) == (102, [None, 3.0, 5.0], [None, 4.0, 5.0])
    h.append(200, 7.0, 7.0, keep=3)  # longer gap than the history: start afresh
    assert (h.first_window, h.avg) == (200, [7.0])
    with pytest.raises(ValueError, match="already recorded"):
        h.append(200, 1.0, 1.0, keep=3)


def test_trace_series_uses_the_same_definitions():
    avg, peak = series_from_arrivals([0.5, 1.0, 1.5, 6.0, 12.0], window_s=10.0, slot_s=5.0, windows=2)
    assert avg == pytest.approx([0.4, 0.1])
    assert peak == pytest.approx([3 / 5, 1 / 5])


def test_a_window_closed_again_after_a_crash_is_recorded_once():
    from services.predictor.actor import Predictor
    from services.predictor.windows import WindowLoad
    from shared.config import load_config

    predictor = Predictor(load_config(), "predictor-t")
    predictor._record(7, {"a": WindowLoad(avg_rps=1.0, peak_rps=2.0)})
    predictor._record(7, {"a": WindowLoad(avg_rps=9.0, peak_rps=9.0)})  # history stored, open windows not
    predictor._record(8, None)
    h = predictor.histories["a"]
    assert (h.first_window, h.avg, h.peak) == (7, [1.0, None], [2.0, None])
