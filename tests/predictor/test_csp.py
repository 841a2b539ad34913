"""WarmServe's corrective seasonal predictor (Eqs. 2-4) on worked numbers, and its baselines."""
from __future__ import annotations

import random

import pytest

from shared.policy.warmserve_predictor import (
    CspParams, correction, forecast, last_value, predict, predict_series, relative_errors, seasonal, seasonal_naive,
    weight,
)

# S = 4 windows per season; day 0, day 1, and the first two windows of day 2
SERIES = [10.0, 20.0, 30.0, 40.0, 12.0, 22.0, 28.0, 44.0, 15.0, 24.0]


def test_seasonal_term_is_the_mean_of_the_same_window_in_past_seasons():
    p = CspParams(windows_per_season=4)
    assert seasonal(SERIES, 10, p) == (28.0 + 30.0) / 2  # Eq. 2, D = all (2) seasons
    assert seasonal(SERIES, 10, CspParams(windows_per_season=4, seasons=1)) == 28.0
    assert seasonal(SERIES, 3, p) is None  # no past season yet


def test_correction_weights_recent_errors_most_as_the_text_says():
    p = CspParams(windows_per_season=4, lookback=2)
    # errors: window 9: 24 - (22 + 20) / 2 = 3 (j = 1); window 8: 15 - (12 + 10) / 2 = 4 (j = 2)
    assert correction(SERIES, 10, p) == pytest.approx((3 * 2 + 4 * 1) / 3)
    assert predict(SERIES, 10, p) == pytest.approx(29 + 10 / 3)  # Eq. 4


def test_printed_eq3_weights_2_to_the_j_minus_1():
    p = CspParams(windows_per_season=4, lookback=2, weighting="printed")
    assert correction(SERIES, 10, p) == pytest.approx((3 * 1 + 4 * 2) / (2**2 - 1))
    assert predict(SERIES, 10, p) == pytest.approx(29 + 11 / 3)


@pytest.mark.parametrize("weighting", ["recent", "printed"])
def test_weights_sum_to_2n_minus_1_so_a_constant_error_is_the_correction(weighting):
    p = CspParams(windows_per_season=5, seasons=1, lookback=10, weighting=weighting)
    assert sum(weight(j, p) for j in range(1, 11)) == 2**10 - 1
    day = [5.0, 7.0, 9.0, 11.0, 13.0]
    series = [v + 2.5 * k for k in range(3) for v in day]  # every day runs 2.5 above the one before
    # window 17 (day 3, i = 2): P = 9 + 2 * 2.5 (yesterday), and every error of the last 10 windows is 2.5
    assert seasonal(series, 17, p) == pytest.approx(14.0)
    assert correction(series + [12.5, 14.5], 17, p) == pytest.approx(2.5)
    assert predict(series + [12.5, 14.5], 17, p) == pytest.approx(9 + 3 * 2.5)


def test_missing_windows_are_left_out_of_both_sums():
    p = CspParams(windows_per_season=4, lookback=2)
    gappy = SERIES[:8] + [None, 24.0]
    assert correction(gappy, 10, p) == pytest.approx(3.0)  # only window 9's error remains
    gappy_season = [10.0, 20.0, None, 40.0] + SERIES[4:]
    assert seasonal(gappy_season, 10, p) == 28.0


def test_cold_start_is_a_weighted_mean_of_recent_loads():
    p = CspParams(windows_per_season=100, lookback=2)
    assert predict([4.0, 10.0], 2, p) == pytest.approx((10 * 2 + 4 * 1) / 3)
    assert predict([], 0, p) == 0.0


def test_forecast_is_never_negative_and_the_peak_never_below_the_average():
    p = CspParams(windows_per_season=2, lookback=1)
    assert predict([10.0, 10.0, 10.0, 0.0], 4, p) == 0.0  # 10 + (0 - 10) = 0, clamped from below
    fc = forecast([5.0, 5.0], [1.0, 1.0], 2, p)  # window 1 has no season: no correction for 2
    assert fc.avg == pytest.approx(5.0) and fc.peak == fc.avg


def test_baselines():
    assert last_value(SERIES, 10) == 24.0
    assert last_value([3.0, None], 2) == 3.0
    assert seasonal_naive(SERIES, 10, 4) == 28.0
    assert seasonal_naive(SERIES, 2, 4) == 20.0  # no season yet: the last value


def test_relative_errors_skip_zero_actuals():
    assert relative_errors([11.0, 5.0, 9.0], [10.0, 0.0, 10.0]) == pytest.approx([0.1, 0.1])
    with pytest.raises(ValueError, match="2 predictions for 1"):
        relative_errors([1.0, 2.0], [1.0])


def test_bad_parameters_are_refused_by_name():
    with pytest.raises(ValueError, match="lookback"):
        CspParams(windows_per_season=4, lookback=0)
    with pytest.raises(ValueError, match="whole number of windows"):
        CspParams.for_windows(7.0, 86_400.0)
    assert CspParams.for_windows(300.0, 86_400.0).windows_per_season == 288


@pytest.mark.parametrize("weighting", ["recent", "printed"])
def test_predict_series_equals_predict_window_by_window(weighting):
    rng = random.Random(7)
    series = [None if rng.random() < 0.1 else rng.uniform(0, 50) for _ in range(60)]
    for p in (CspParams(windows_per_season=7, lookback=4, weighting=weighting),
              CspParams(windows_per_season=5, seasons=2, lookback=10, weighting=weighting)):
        assert predict_series(series, p) == pytest.approx([predict(series, w, p) for w in range(60)])
