"""The step timeline of `tidal bench transfer --trace` (pure: recorded steps in, segments out)."""
from __future__ import annotations

import pytest

from services.gpu_worker.transfer import timeline
from tidal.bench.transfer_timeline import breakdown, report


def test_steps_are_recorded_only_while_enabled() -> None:
    timeline.mark("submit", 1)
    assert timeline.EVENTS is None
    timeline.enable()
    timeline.mark("submit", 1)
    timeline.mark("post", 1, 0)
    events = timeline.disable()
    assert [(step, tid, index) for step, tid, index, _ in events] == [("submit", 1, 0), ("post", 1, 0)]
    assert events[0][3] <= events[1][3] and timeline.EVENTS is None


def test_an_activation_is_split_into_steps_and_bulk_chunks_ahead_are_counted() -> None:
    sender = [("post", 9, 0, 0.000), ("post", 9, 1, 0.004),  # bulk chunks 0 and 1 posted before the submit
              ("submit", 5, 0, 0.005), ("post", 5, 0, 0.006), ("ack", 5, 0, 0.020)]
    receiver = [("landed", 9, 0, 0.003),  # chunk 0 is in before the submit; chunk 1 lands after it
                ("start", 5, 0, 0.010), ("landed", 5, 0, 0.010), ("landed", 9, 1, 0.009),
                ("verified", 5, 0, 0.012)]
    (row,) = breakdown(sender, receiver, activations={5}, bulk={9})
    assert row["queued"] == pytest.approx(1.0) and row["to_rx"] == pytest.approx(4.0)
    assert row["payload"] == pytest.approx(0.0) and row["verify"] == pytest.approx(2.0)
    assert row["ack"] == pytest.approx(8.0) and row["total"] == pytest.approx(15.0)
    assert row["bulk_ahead"] == 1.0
    assert "slowest 1%" in report([row])
    assert breakdown(sender[:3], receiver, activations={5}, bulk={9}) == []  # not fully traced: left out
