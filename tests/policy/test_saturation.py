"""Saturation measured from an instance's stats (shared/policy/saturation.py): queue wait and decode pace."""
from __future__ import annotations

import pytest

from shared.policy.saturation import InstanceLoad, SaturationMonitor, SaturationParams


def feed(mon: SaturationMonitor, start: float, end: float, loads: list[InstanceLoad], queued: int = 0,
         model: str = "m") -> None:
    t = start
    while t <= end:
        mon.observe(model, t, loads, queued)
        t += 1.0


def test_requests_waiting_per_instance_over_the_window_is_saturation() -> None:
    mon = SaturationMonitor(SaturationParams(window_s=5.0))
    feed(mon, 0, 10, [InstanceLoad(running=16, waiting=19, tokens_per_s=17.0)])
    why = mon.verdict("m", 10)
    assert why is not None and "19.0 requests waiting per instance" in why


def test_the_dispatchers_queue_counts_as_waiting_and_is_shared_by_the_instances() -> None:
    mon = SaturationMonitor(SaturationParams(window_s=5.0, wait_per_instance=2.0))
    two = [InstanceLoad(1, 0, 10.0), InstanceLoad(1, 0, 10.0)]
    feed(mon, 0, 10, two, queued=3)  # 1.5 per instance: below 2
    assert mon.verdict("m", 10) is None
    feed(mon, 11, 20, two, queued=5)  # 2.5 per instance
    assert mon.verdict("m", 20) is not None


def test_a_decode_pace_5x_below_the_best_it_showed_is_saturation() -> None:
    mon = SaturationMonitor(SaturationParams(window_s=5.0, tpot_factor=5.0))
    feed(mon, 0, 10, [InstanceLoad(1, 0, 15.0)])  # unloaded: 15 tok/s for its one request
    assert mon.allowed_pace("m") == pytest.approx(3.0)
    feed(mon, 11, 20, [InstanceLoad(8, 0, 40.0)])  # 5 tok/s each: slower, within the SLO
    assert mon.verdict("m", 20) is None
    feed(mon, 21, 30, [InstanceLoad(16, 0, 17.0)])  # ~1 tok/s each
    why = mon.verdict("m", 30)
    assert why is not None and "decode pace 1.06 tok/s per request" in why and "< 3.00" in why


def test_an_absolute_tpot_sets_the_pace_and_one_request_is_never_judged() -> None:
    mon = SaturationMonitor(SaturationParams(window_s=5.0, tpot_s=0.2, tpot_factor=None))
    feed(mon, 0, 10, [InstanceLoad(1, 0, 2.0)])  # slow, but alone: its pace is the unloaded pace
    assert mon.verdict("m", 10) is None
    feed(mon, 11, 20, [InstanceLoad(4, 0, 12.0)])  # 3 tok/s each < 1 / 0.2 s
    assert mon.verdict("m", 20) is not None


def test_no_verdict_for_a_window_after_the_serving_count_changes() -> None:
    mon = SaturationMonitor(SaturationParams(window_s=5.0))
    feed(mon, 0, 10, [InstanceLoad(4, 6, 8.0)])
    assert mon.verdict("m", 10) is not None
    feed(mon, 11, 13, [InstanceLoad(4, 6, 8.0), InstanceLoad(0, 0, 0.0)])  # a second instance came
    assert mon.verdict("m", 13) is None  # the window has not seen it take load yet
    feed(mon, 14, 17, [InstanceLoad(4, 6, 8.0), InstanceLoad(4, 6, 8.0)])
    assert mon.verdict("m", 17) is not None  # still waiting with both: saturated again


@pytest.mark.parametrize("kwargs, words", [
    ({"tpot_s": 0.1}, "exactly one of"),
    ({"tpot_s": None, "tpot_factor": None}, "exactly one of"),
    ({"tpot_factor": 1.0}, "tpot_factor > 1"),
    ({"wait_per_instance": 0}, "wait_per_instance > 0"),
])
def test_bad_parameters_are_refused_by_name(kwargs: dict, words: str) -> None:
    with pytest.raises(ValueError, match=words):
        SaturationParams(**kwargs)
