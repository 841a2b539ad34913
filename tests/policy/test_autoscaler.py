"""The public code's autoscaler (shared/policy/autoscaler.py) on worked numbers: the windowed load, the
0.8 / 0.5 thresholds over B per instance, the protect period, scale to zero, the direct start."""
from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from shared.policy.autoscaler import AutoscaleParams, LoadWindow, Member, decide, direct_start

P = AutoscaleParams()  # B 32, 0.8 / 0.5, 5 s window, 5 s protect


def test_the_public_codes_constants() -> None:
    assert (P.batch_size, P.scale_up_at, P.scale_down_at, P.window_s, P.protect_s, P.period_s) == \
        (32, 0.8, 0.5, 5.0, 5.0, 0.5)


def test_the_window_averages_a_step_function_with_zero_before_the_first_sample() -> None:
    w = LoadWindow(5.0)
    w.record(10.0, 40)
    assert w.mean(12.0) == pytest.approx(40 * 2 / 5)  # 0 for 3 s, 40 for 2 s
    w.record(12.0, 10)
    assert w.mean(14.0) == pytest.approx((40 * 2 + 10 * 2) / 5)
    assert w.mean(30.0) == pytest.approx(10)  # the last value held the whole window
    assert w.last == 10


def test_old_samples_are_dropped_but_the_one_shaping_the_window_is_kept() -> None:
    w = LoadWindow(5.0)
    for t in range(100):
        w.record(float(t), t % 3)
    assert len(w._points) <= 7
    # [94.5, 99.5]: 1 for 0.5 s (from 94), then 2, 0, 1, 2 for 1 s each, 0 for 0.5 s
    assert w.mean(99.5) == pytest.approx(5.5 / 5)
    with pytest.raises(ValueError, match="older"):
        w.record(50.0, 1)


@given(st.lists(st.tuples(st.floats(0, 3), st.integers(0, 100)), min_size=1, max_size=40), st.floats(0, 10))
def test_the_mean_lies_between_zero_and_the_largest_load(samples, extra) -> None:
    w, t = LoadWindow(5.0), 0.0
    for dt, load in samples:
        t += dt
        w.record(t, load)
    assert 0.0 <= w.mean(t + extra) <= max(load for _, load in samples) + 1e-9


def members(*ages_requests: tuple[float, int], now: float = 100.0) -> list[Member]:
    return [Member(f"i{k}", now - age, req) for k, (age, req) in enumerate(ages_requests)]


def test_above_80_percent_of_capacity_starts_enough_instances() -> None:
    one = members((60, 32))
    assert decide(25.6, one, 0, 100.0, P).start == 0  # exactly 0.8 x 32: not above
    d = decide(26.0, one, 0, 100.0, P)
    assert (d.start, d.stop, d.capacity) == (1, (), 32)  # ceil(26 / 0.8 / 32) = 2
    assert decide(90.0, one, 0, 100.0, P).start == 3  # ceil(90 / 25.6) = 4
    assert decide(90.0, one, 2, 100.0, P).start == 1  # two already starting count as capacity


def test_below_50_percent_stops_the_least_busy_past_the_protect_period() -> None:
    three = members((60, 9), (60, 2), (3, 0))  # i2 is 3 s old: protected
    d = decide(20.0, three, 0, 100.0, P)  # keep ceil(20 / 16) = 2 of 3
    assert d.stop == ("i1",)
    d = decide(0.0, three, 0, 100.0, P)  # no load: all may go, but i2 is protected
    assert d.stop == ("i1", "i0")
    assert decide(40.0, three, 0, 100.0, P).stop == ()  # 40 >= 0.5 x 96
    ruled_out = [Member("i0", 0.0, 5, stoppable=False), Member("i1", 0.0, 0)]
    assert decide(0.0, ruled_out, 0, 100.0, P).stop == ("i1",)


def test_nothing_happens_for_a_model_with_no_load_and_no_instance() -> None:
    d = decide(0.0, [], 0, 0.0, P)
    assert (d.start, d.stop, d.capacity) == (0, (), 0)
    assert decide(0.5, [], 0, 0.0, P).start == 1  # any load on no capacity


def test_direct_start_only_when_full_and_nothing_starting() -> None:
    assert direct_start(has_room=False, starting=0)
    assert not direct_start(has_room=True, starting=0)
    assert not direct_start(has_room=False, starting=1)


def test_bad_parameters_are_refused() -> None:
    with pytest.raises(ValueError, match="scale_down_at < scale_up_at"):
        AutoscaleParams(scale_up_at=0.5, scale_down_at=0.8)
    with pytest.raises(ValueError, match="window_s > 0"):
        AutoscaleParams(window_s=0)
    with pytest.raises(ValueError, match="window_s"):
        LoadWindow(0)
