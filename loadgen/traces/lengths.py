"""Prompt and output length distributions fitted to published quantiles.

KunServe Table 2 gives, per dataset, the mean and P50/P80/P95/P99 of input and output
lengths. We build a distribution whose quantile function Q(p) passes exactly through
those quantiles and whose mean is the published mean:

- Q is piecewise log-linear in p (log Q linear between knots) through the knots
  (0, q_min), (0.5, P50), (0.8, P80), (0.95, P95), (0.99, P99), (1, q_max).
- q_max extends the last segment's log-slope (P95 -> P99) over [0.99, 1].
- q_min (the smallest length) is solved by bisection so that the mean, the integral of
  Q over [0, 1] (closed form per segment), equals the published mean. If even q_min = 1
  gives too large a mean, q_max is lowered towards P99; if q_min = P50 gives too small
  a mean, q_max is raised. Either way the four quantiles stay exact.

Sampling is inverse-transform: Q(U) for U ~ Uniform(0, 1), rounded to an integer >= 1.
"""
from __future__ import annotations

import math

import msgspec
import numpy as np

KNOT_PS = (0.5, 0.8, 0.95, 0.99)


class LengthQuantiles(msgspec.Struct, frozen=True):
    """A published summary: mean and P50/P80/P95/P99."""

    mean: float
    p50: float
    p80: float
    p95: float
    p99: float


class DatasetLengths(msgspec.Struct, frozen=True):
    prompt: LengthQuantiles
    output: LengthQuantiles
    source: str


# KunServe Table 2 (BurstGPT, AzureConv, AGIEval-CoT). AzureCode is approximate: its
# medians follow Splitwise's characterisation of the Azure code trace (prompt ~1500,
# output ~13 tokens); its other quantiles and means are our assumptions.
DATASETS: dict[str, DatasetLengths] = {
    "burstgpt": DatasetLengths(LengthQuantiles(603, 400, 1146, 1804, 2009),
                               LengthQuantiles(289, 249, 462, 715, 1161), "KunServe Table 2"),
    "azureconv": DatasetLengths(LengthQuantiles(1013, 998, 1159, 4080, 4096),
                                LengthQuantiles(247, 202, 411, 451, 585), "KunServe Table 2"),
    "agieval-cot": DatasetLengths(LengthQuantiles(237, 128, 556, 619, 651),
                                  LengthQuantiles(390, 363, 450, 578, 698), "KunServe Table 2"),
    "azurecode": DatasetLengths(LengthQuantiles(2048, 1500, 3000, 5500, 7400),
                                LengthQuantiles(28, 13, 30, 100, 250), "approximate (Splitwise medians)"),
}


def _segment_mean_mass(p0: float, p1: float, a: float, b: float) -> float:
    """Integral of a log-linear Q from p0 (value a) to p1 (value b)."""
    if abs(b - a) <= 1e-12 * max(a, b):
        return (p1 - p0) * a
    return (p1 - p0) * (b - a) / math.log(b / a)


class QuantileLengths:
    """A length distribution through given quantiles with a given mean (see module doc)."""

    def __init__(self, target: LengthQuantiles) -> None:
        q = (target.p50, target.p80, target.p95, target.p99)
        if any(v < 1 for v in q) or any(b < a for a, b in zip(q, q[1:])):
            raise ValueError(f"quantiles must be >= 1 and non-decreasing, got {q}")
        self.target = target
        tail_slope = math.log(target.p99 / target.p95) / (0.99 - 0.95)
        q_max = target.p99 * math.exp(tail_slope * 0.01)
        if self._mean(1.0, q_max) > target.mean:
            q_max = self._bisect(lambda x: self._mean(1.0, x), target.p99, q_max, target.mean)
        elif self._mean(target.p50, q_max) < target.mean:
            q_max = self._bisect(lambda x: self._mean(target.p50, x), q_max, 1000 * target.p99, target.mean)
        if self._mean(1.0, q_max) > target.mean * (1 + 1e-6):
            raise ValueError(f"mean {target.mean} is too small for quantiles {q}")
        q_min = self._bisect(lambda x: self._mean(x, q_max), 1.0, target.p50, target.mean)
        self.ps = np.array((0.0, *KNOT_PS, 1.0))
        self.log_qs = np.log(np.array((q_min, *q, q_max)))
        self.q_min, self.q_max = q_min, q_max

    def _mean(self, q_min: float, q_max: float) -> float:
        t = self.target
        ps = (0.0, *KNOT_PS, 1.0)
        qs = (q_min, t.p50, t.p80, t.p95, t.p99, q_max)
        return sum(_segment_mean_mass(ps[i], ps[i + 1], qs[i], qs[i + 1]) for i in range(5))

    @staticmethod
    def _bisect(f, lo: float, hi: float, goal: float) -> float:  # f increasing
        for _ in range(200):
            mid = math.sqrt(lo * hi)
            if f(mid) < goal:
                lo = mid
            else:
                hi = mid
        return math.sqrt(lo * hi)

    def quantile(self, p: np.ndarray | float) -> np.ndarray:
        return np.exp(np.interp(p, self.ps, self.log_qs))

    def mean(self) -> float:
        return self._mean(float(np.exp(self.log_qs[0])), float(np.exp(self.log_qs[-1])))

    def sample(self, rng: np.random.Generator, n: int) -> np.ndarray:
        return np.maximum(1, np.rint(self.quantile(rng.random(n)))).astype(np.int64)


def dataset_lengths(name: str) -> tuple[QuantileLengths, QuantileLengths]:
    """(prompt, output) length distributions of a named dataset."""
    try:
        ds = DATASETS[name]
    except KeyError:
        raise ValueError(f"unknown length dataset {name!r}; known: {', '.join(DATASETS)}") from None
    return QuantileLengths(ds.prompt), QuantileLengths(ds.output)


def sample_lengths(name: str, rng: np.random.Generator, n: int) -> tuple[np.ndarray, np.ndarray]:
    """n (prompt, output) length pairs, drawn independently from the named dataset."""
    prompt, output = dataset_lengths(name)
    return prompt.sample(rng, n), output.sample(rng, n)
