"""The spike guard (shared/policy/forecast_guard.py): worked numbers, a level shift, causality, bad input."""
from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shared.policy.forecast_ensemble import EnsembleParams, ensemble_series
from shared.policy.forecast_guard import GuardParams, guard_series, guarded_ensemble_series, spike_weight
from shared.policy.forecast_members import MemberParams
from shared.policy.warmserve_predictor import last_value


def test_worked_numbers() -> None:
    p = GuardParams(baseline_windows=3, jump=2.0, min_error=0.2)
    series = [10.0, 10.0, 10.0, 20.0, 20.0]
    # forecasts of windows 0..4: 10% off on 0-2 (usual error 0.1)
    fc = [11.0, 9.0, 11.0, 8.0, 12.0]  # window 3's forecast missed by 0.6
    assert spike_weight(series, fc, 4, p) == 1.0  # 0.6 / 0.1 = 6x its usual error, past jump 2x
    assert guard_series(series, fc, p)[4] == 20.0  # all the way to the last value
    assert guard_series(series, fc, p)[:4] == fc[:4]  # errors at their usual level: untouched
    half = GuardParams(baseline_windows=3, jump=11.0, min_error=0.2)  # 6x of 11x: lam = (6 - 1) / 10
    assert spike_weight(series, fc, 4, half) == pytest.approx(0.5)
    assert guard_series(series, fc, half)[4] == pytest.approx(0.5 * 20.0 + 0.5 * 12.0)
    # an error below min_error is never a spike, however it compares with the usual one
    assert spike_weight([10.0, 10.0, 10.0], [10.0, 10.0, 11.5], 3, p) == 0.0
    # a usual error of 0: any miss above min_error that the last value did better on goes all the way
    assert spike_weight([10.0, 20.0], [10.0, 5.0], 2, p) == 1.0
    assert spike_weight([10.0, 20.0], [10.0, 10.0], 2, p) == 0.0  # the last value missed it as badly


FLAT = [20.0 + 2.5 * math.sin(1.7 * k) for k in range(60)]  # an hour of a noisy flat load: slow members weigh most


def test_a_level_shift_is_followed_once_the_last_value_shows_it() -> None:
    series = FLAT + [60.0 + 2.5 * math.sin(1.7 * k) for k in range(8)]  # the load triples at window 60
    params = EnsembleParams(MemberParams(windows_per_season=1000))
    raw = [e.point for e in ensemble_series(series, params, len(series))]
    guarded = guarded_ensemble_series(series, params, GuardParams(), len(series))
    # window 61: both the ensemble and the last value missed window 60, so nothing says which follows
    assert guarded[:62] == raw[:62]
    # window 62: the ensemble missed 61 by far more than usual and than the last value did: last value
    assert guarded[62] == pytest.approx(series[61])
    assert abs(guarded[62] - series[62]) < 0.5 * abs(raw[62] - series[62])
    assert guarded[64:] == raw[64:]  # once the ensemble caught up, the guard lets go


def test_a_one_window_spike_is_not_carried() -> None:
    series = FLAT + [60.0] + FLAT[:8]  # one window at three times the load, then back
    params = EnsembleParams(MemberParams(windows_per_season=1000))
    raw = [e.point for e in ensemble_series(series, params, len(series))]
    guarded = guarded_ensemble_series(series, params, GuardParams(), len(series))
    assert guarded[:62] == raw[:62]  # the spike's 60 is not carried into window 61 (the last value missed it too)
    err = (lambda fc: sum(abs(fc[w] - series[w]) / series[w] for w in range(61, len(series))))
    assert err(guarded) < err(raw)  # and where the ensemble hangs on to the spike, the guard pulls it back


@settings(max_examples=60, deadline=None)
@given(st.lists(st.floats(min_value=0.0, max_value=100.0), min_size=2, max_size=30), st.data())
def test_guarded_lies_between_the_forecast_and_the_last_value_and_is_causal(series, data) -> None:
    fc = data.draw(st.lists(st.floats(min_value=0.0, max_value=100.0), min_size=len(series), max_size=len(series)))
    p = GuardParams(baseline_windows=4)
    out = guard_series(series, fc, p)
    for w, g in enumerate(out):
        lo, hi = sorted((fc[w], last_value(series, w)))
        assert lo - 1e-9 <= g <= hi + 1e-9
    w = len(series) // 2  # what happens from window w on does not change the guarded forecast of w
    changed = series[:w] + [x + 50.0 for x in series[w:]]
    assert guard_series(changed, fc, p)[w] == pytest.approx(out[w])


def test_bad_parameters_are_refused() -> None:
    with pytest.raises(ValueError, match="jump must be > 1"):
        GuardParams(jump=1.0)
    with pytest.raises(ValueError, match="baseline_windows"):
        GuardParams(baseline_windows=0)
    with pytest.raises(ValueError, match="min_error"):
        GuardParams(min_error=-0.1)


def test_guarded_at_is_the_series_forecast_of_one_window_and_moves_its_quantiles_with_the_point() -> None:
    from shared.policy.forecast_ensemble import ensemble_at
    from shared.policy.forecast_guard import guarded_at

    series = FLAT[:30] + [60.0 + 2.5 * math.sin(1.7 * k) for k in range(8)] + [None, 61.0]
    params = EnsembleParams(MemberParams(windows_per_season=12), error_windows=8, residual_windows=10)
    guard = GuardParams(baseline_windows=4)
    whole = guarded_ensemble_series(series, params, guard)
    acted = 0
    for w in range(len(series) + 1):
        fc, lam = guarded_at(series, w, params, guard)
        raw = ensemble_at(series, w, params)
        assert fc.point == pytest.approx(whole[w], abs=1e-9), w
        assert lam == pytest.approx(spike_weight(series, [e.point for e in ensemble_series(series, params)], w, guard))
        delta = fc.point - raw.point
        for (q, v), (q0, v0) in zip(fc.quantiles, raw.quantiles):
            assert q == q0 and v == pytest.approx(max(0.0, v0 + delta))
        acted += lam > 0
    assert acted >= 1  # the shift at window 30 moved at least one forecast
