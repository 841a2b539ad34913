"""Length distributions reproduce KunServe Table 2 (mean and P50/P80/P95/P99).

Tolerance: sampled mean and quantiles within 5% of the table (the task allows 10%);
the fitted quantile function passes through the table's quantiles exactly.
"""
from __future__ import annotations

import numpy as np
import pytest

from loadgen.traces.lengths import DATASETS, LengthQuantiles, QuantileLengths, dataset_lengths

TABLE2 = ["burstgpt", "azureconv", "agieval-cot"]


@pytest.mark.parametrize("name", [*TABLE2, "azurecode"])
def test_quantile_function_is_exact_at_the_knots_and_mean_matches(name: str) -> None:
    for dist, target in zip(dataset_lengths(name), (DATASETS[name].prompt, DATASETS[name].output)):
        got = dist.quantile(np.array([0.5, 0.8, 0.95, 0.99]))
        np.testing.assert_allclose(got, [target.p50, target.p80, target.p95, target.p99], rtol=1e-9)
        assert dist.mean() == pytest.approx(target.mean, rel=1e-4)
        assert 1 <= dist.q_min <= target.p50 and dist.q_max >= target.p99


@pytest.mark.parametrize("name", TABLE2)
def test_samples_match_table2(name: str) -> None:
    rng = np.random.default_rng(7)
    for dist, target in zip(dataset_lengths(name), (DATASETS[name].prompt, DATASETS[name].output)):
        s = dist.sample(rng, 40_000)
        assert s.min() >= 1 and s.dtype == np.int64
        assert s.mean() == pytest.approx(target.mean, rel=0.05)
        got = np.percentile(s, [50, 80, 95, 99])
        np.testing.assert_allclose(got, [target.p50, target.p80, target.p95, target.p99], rtol=0.05)


def test_mean_out_of_reach_raises_or_moves_the_tail() -> None:
    with pytest.raises(ValueError, match="too small"):
        QuantileLengths(LengthQuantiles(mean=10, p50=400, p80=500, p95=600, p99=700))
    heavy = QuantileLengths(LengthQuantiles(mean=700, p50=400, p80=500, p95=600, p99=700))
    assert heavy.mean() == pytest.approx(700, rel=1e-4)
    assert heavy.q_max > 700  # the tail beyond P99 carried the extra mean
    with pytest.raises(ValueError, match="non-decreasing"):
        QuantileLengths(LengthQuantiles(mean=10, p50=40, p80=30, p95=60, p99=70))
    with pytest.raises(ValueError, match="unknown length dataset"):
        dataset_lengths("sharegpt")


def test_schema_names_every_dataset() -> None:
    from typing import get_args

    from loadgen.traces.schema import LengthDataset

    assert sorted(get_args(LengthDataset)) == sorted(DATASETS)
