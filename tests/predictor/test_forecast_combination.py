"""How the ensemble weighs its members (shared/policy/forecast_combination.py): duplicates, the
shrinkage towards the best member while the error sample is small, and causality."""
from __future__ import annotations

import math
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shared.policy.forecast_combination import combination_weights, min_variance, stein_factor
from shared.policy.forecast_ensemble import EnsembleParams, ensemble_series
from shared.policy.forecast_members import MemberParams, member_series

error_rows = st.lists(st.tuples(st.floats(0.01, 1.0), st.lists(st.floats(-1.0, 1.0), min_size=3, max_size=3)),
                      min_size=0, max_size=30)


def mean_abs_rel(forecasts: list[float], actual: list[float], first: int) -> float:
    return sum(abs(f - a) / a for f, a in zip(forecasts[first:], actual[first:])) / (len(actual) - first)


@settings(max_examples=80, deadline=None)
@given(error_rows, st.lists(st.floats(0.0, 1e4), min_size=3, max_size=3), st.floats(0.0, 1.0))
def test_weights_are_non_negative_and_sum_to_one(rows, forecasts, shrinkage):
    weights, recent = combination_weights(rows, forecasts, shrinkage)
    assert all(w >= 0 for w in weights) and math.isclose(sum(weights), 1.0, rel_tol=1e-9)
    assert (recent == [None] * 3) == (not rows)


def test_a_copy_of_a_member_adds_no_weight():
    rng = random.Random(2)
    rows = [(0.95 ** k, [rng.gauss(0, 0.1), rng.gauss(0, 0.15)]) for k in range(40)]
    alone, _ = combination_weights(rows, [10.0, 12.0], 0.25)
    doubled, _ = combination_weights([(g, [a, b, a]) for g, (a, b) in rows], [10.0, 12.0, 10.0], 0.25)
    assert doubled[2] == 0.0 and doubled[:2] == pytest.approx(alone)
    # same errors but a different forecast now: not a copy, both weigh
    apart, _ = combination_weights([(g, [a, b, a]) for g, (a, b) in rows], [10.0, 12.0, 11.0], 0.25)
    assert apart[0] > 0 and apart[2] > 0


def test_few_errors_follow_the_best_member_and_many_keep_the_min_variance_weights():
    rng = random.Random(4)
    errs = [[rng.gauss(0, 0.1), rng.gauss(0, 0.12), rng.gauss(0, 0.2)] for _ in range(200)]
    one, _ = combination_weights([(1.0, errs[0])], [1.0, 2.0, 3.0], 0.25)
    best = min(range(3), key=lambda i: errs[0][i] ** 2)
    assert one == [1.0 if i == best else 0.0 for i in range(3)]  # n_eff = 1 <= 3 members: psi = 0
    rows = [(1.0, e) for e in errs]  # undiscounted: n_eff = 200, psi = 1 - 3/200
    weights, _ = combination_weights(rows, [1.0, 2.0, 3.0], 0.25)
    moments = [[sum(e[i] * e[j] for e in errs) / 200 * (1.0 if i == j else 0.75) for j in range(3)] for i in range(3)]
    mv = min_variance(moments)
    psi = stein_factor(3, 200.0)
    assert psi == pytest.approx(1 - 3 / 200)
    expected = [psi * w + (1 - psi) * (i == 0) for i, w in enumerate(mv)]  # member 0 has the least error
    assert weights == pytest.approx(expected)
    assert stein_factor(1, 0.5) == 1.0 and stein_factor(5, 2.0) == 0.0


def test_on_a_random_walk_the_ensemble_converges_to_last_value():
    # a random walk: the last value is the best forecast; the smoothers and seasonal naive lag it.
    # The weights come from 48 discounted windows (n_eff 33), so their noise stays: within 5%, not 0%
    rng = random.Random(11)
    series = [1000.0]
    for _ in range(600):
        series.append(series[-1] + rng.gauss(0, 20))
    p = EnsembleParams(MemberParams(windows_per_season=24))
    points = [fc.point for fc in ensemble_series(series, p, len(series))]
    members = member_series(series, p.members, len(series))
    first = 200
    ens = mean_abs_rel(points, series, first)
    best = mean_abs_rel(members["last_value"], series, first)
    others = [mean_abs_rel(members[m], series, first) for m in members if m != "last_value"]
    assert 1.1 * best < min(others)  # csp, the next best, is 10-25% worse; equal weights would be ~2x
    assert ens <= 1.05 * best
    late = ensemble_series(series, p, len(series))[first:]
    share = sum(next(m.weight for m in fc.members if m.name == "last_value") for fc in late) / len(late)
    assert share > 0.6


@settings(max_examples=30, deadline=None)
@given(st.lists(st.floats(0.5, 1e3), min_size=20, max_size=60), st.data())
def test_a_forecast_does_not_read_the_windows_it_precedes(series, data):
    w = data.draw(st.integers(1, len(series) - 1))
    future = data.draw(st.lists(st.floats(0.5, 1e3), min_size=len(series) - w, max_size=len(series) - w))
    p = EnsembleParams(MemberParams(windows_per_season=5, lookback=3), error_windows=8, residual_windows=12)
    before = ensemble_series(series, p)[w]
    after = ensemble_series(series[:w] + future, p)[w]
    assert after == before
