"""The forecast ensemble (shared/policy/forecast_*.py): worked numbers and invariants (hypothesis)."""
from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shared.policy.forecast_ensemble import EnsembleParams, empirical_quantile, ensemble_at, ensemble_series
from shared.policy.forecast_members import MEMBERS, MemberParams, ewma, member_forecast, member_series
from shared.policy.forecast_outlook import at_least, chance_above, outlook
from shared.policy.warmserve_predictor import CspParams, last_value, predict, seasonal_naive

loads = st.one_of(st.none(), st.floats(min_value=0.0, max_value=1e4, allow_nan=False))
series_st = st.lists(loads, min_size=0, max_size=60)
member_subsets = st.lists(st.sampled_from(MEMBERS), min_size=1, max_size=len(MEMBERS), unique=True)


def params(s: int = 4, members: tuple[str, ...] = MEMBERS, **kw) -> EnsembleParams:
    return EnsembleParams(MemberParams(windows_per_season=s, lookback=3, members=members), error_windows=6,
                          residual_windows=10, **kw)


def test_members_are_the_existing_forecasters():
    series = [10.0, 20.0, None, 40.0, 12.0, 22.0, 28.0]
    p = MemberParams(windows_per_season=4, lookback=3)
    assert member_forecast("csp", series, 7, p) == predict(series, 7, CspParams(windows_per_season=4, lookback=3))
    assert member_forecast("last_value", series, 7, p) == last_value(series, 7) == 28.0
    assert member_forecast("seasonal_naive", series, 7, p) == seasonal_naive(series, 7, 4) == 40.0
    # ewma (alpha 0.3) over windows 6..0 = 28, 22, 12, 40, missing, 20, 10: window k back weighs 0.7^k
    pairs = [(28, 0), (22, 1), (12, 2), (40, 3), (20, 5), (10, 6)]
    expected = sum(v * 0.7**k for v, k in pairs) / sum(0.7**k for _, k in pairs)
    assert member_forecast("ewma", series, 7, p) == pytest.approx(expected)
    assert ewma([], 0, 0.3, 5) == 0.0
    with pytest.raises(ValueError, match="unknown ensemble member 'arima'"):
        member_forecast("arima", series, 7, p)
    with pytest.raises(ValueError, match="members must be distinct names"):
        MemberParams(windows_per_season=4, members=("csp", "csp"))


def test_the_member_with_smaller_errors_gets_more_weight_and_quantiles_track_residuals():
    flat = [100.0] * 40  # last value is exact; seasonal naive of a flat series too; the EWMAs converge
    fc = ensemble_series(flat, params())[-1]
    assert fc.point == pytest.approx(100.0)
    noisy = [100.0 + (15.0 if w % 2 else -15.0) for w in range(40)]  # alternating: last value is always 30% off
    fc = ensemble_series(noisy, params(s=2))[-1]
    weights = {m.name: m.weight for m in fc.members}
    # a season of 2 windows sees the alternation exactly: seasonal naive and CSP make no error, and share it all
    assert weights["seasonal_naive"] + weights["csp"] == pytest.approx(1.0) and weights["last_value"] == 0.0
    assert fc.point == pytest.approx(noisy[-2])
    assert fc.quantile(0.5) <= fc.quantile(0.9)


def test_coverage_of_p90_on_noise_is_near_ninety_percent():
    import random
    rng = random.Random(5)
    series = [100.0 + rng.gauss(0, 10) for _ in range(600)]
    p = EnsembleParams(MemberParams(windows_per_season=7), residual_windows=96)
    fcs = ensemble_series(series, p)
    hits = [series[w] <= fcs[w].quantile(0.9) for w in range(100, 600)]
    assert 0.8 <= sum(hits) / len(hits) <= 0.97


@settings(max_examples=60, deadline=None)
@given(series_st, member_subsets)
def test_weights_are_a_distribution_and_quantiles_are_ordered(series, members):
    for fc in ensemble_series(series, params(members=tuple(members))):
        weights = [m.weight for m in fc.members]
        assert all(w >= 0 for w in weights) and math.isclose(sum(weights), 1.0, rel_tol=1e-9)
        values = [v for _, v in fc.quantiles]
        assert values == sorted(values) and all(v >= 0 for v in values)
        assert min(m.forecast for m in fc.members) - 1e-6 <= fc.point <= max(m.forecast for m in fc.members) + 1e-6


@settings(max_examples=40, deadline=None)
@given(series_st, st.sampled_from(MEMBERS))
def test_an_ensemble_of_one_member_is_that_member(series, member):
    p = params(members=(member,))
    alone = member_series(series, p.members)[member]
    assert [fc.point for fc in ensemble_series(series, p)] == pytest.approx(alone)


@settings(max_examples=40, deadline=None)
@given(st.lists(loads, min_size=0, max_size=70))
def test_one_window_equals_the_whole_series_pass(series):
    p = params()
    every = ensemble_series(series, p)
    for w in {0, len(series) // 2, len(series)}:
        assert ensemble_at(series, w, p) == every[w]


def test_peak_outlook_is_never_below_the_average():
    avg = [10.0, 12.0, 11.0, 30.0, 12.0]
    peak = [5.0, 6.0, 5.0, 6.0, 5.0]  # below the average: the peak outlook is raised to it
    o = outlook(avg, peak, 5, params())
    assert o.peak.point >= o.avg.point
    assert all(pv >= av for (_, pv), (_, av) in zip(o.peak.quantiles, o.avg.quantiles))
    assert at_least(o.avg, o.avg) == o.avg


def test_chance_above_reads_the_two_quantiles_as_a_normal():
    assert chance_above(10.0, 20.0, 10.0) == pytest.approx(0.5)
    assert chance_above(10.0, 20.0, 20.0) == pytest.approx(0.1)
    assert chance_above(10.0, 20.0, 0.0) == pytest.approx(0.9)  # symmetric about the median
    assert chance_above(10.0, 10.0, 9.9) == 1.0 and chance_above(10.0, 10.0, 10.0) == 0.0
    with pytest.raises(ValueError, match="p90 .* must be >= p50"):
        chance_above(20.0, 10.0, 5.0)


@given(st.floats(0, 100), st.floats(0, 100), st.floats(-10, 200), st.floats(-10, 200))
def test_chance_above_falls_as_the_level_rises(p50, spread, lo, hi):
    lo, hi = sorted((lo, hi))
    c_lo, c_hi = chance_above(p50, p50 + spread, lo), chance_above(p50, p50 + spread, hi)
    assert 0.0 <= c_hi <= c_lo <= 1.0


def test_bad_parameters_are_named():
    with pytest.raises(ValueError, match="quantiles must be distinct, ascending"):
        params(quantiles=(0.9, 0.5))
    with pytest.raises(ValueError, match="shrinkage must be in"):
        params(shrinkage=2.0)
    assert empirical_quantile([3.0, 1.0, 2.0], 0.5) == 2.0
    with pytest.raises(ValueError, match="no values"):
        empirical_quantile([], 0.5)


def test_a_burst_does_not_rule_the_weights_once_errors_are_capped():
    # a level series with small wiggles, then a one-window spike: the window after it, last value
    # forecasts the spike (700% off) while the EWMAs are off less; uncapped, that one window would
    # keep last value's weight near 0 for the next 48 windows
    series = [100.0 + (3.0 if w % 3 == 0 else -1.0) for w in range(60)]
    series[40] = 800.0
    members = ("last_value", "ewma")

    def last_value_weight(cap: float) -> float:
        fc = ensemble_series(series, params(members=members, error_cap=cap))[46]
        return next(m.weight for m in fc.members if m.name == "last_value")

    assert last_value_weight(1.0) > 2 * last_value_weight(1e3)


def test_a_burst_out_of_idle_keeps_every_quantile_a_load_the_wire_accepts():
    # idle windows make the residual floor 1e-12: unclamped, the burst's residual was ~5e12 and the
    # predictor's forecasts (p90 1.4e12) were refused by every reader (Load <= 1e12)
    series = [0.0] * 20 + [5.0] + [0.0] * 3 + [0.5] * 3
    qs = [v for fc in ensemble_series(series, params()) for _, v in fc.quantiles]
    assert all(math.isfinite(v) and 0 <= v <= 100 for v in qs)
    assert max(qs) > 0.5  # the burst still widens the quantiles
