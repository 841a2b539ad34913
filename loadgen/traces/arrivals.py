"""Arrival processes with a time-varying rate, by time rescaling.

If Lambda(t) is the cumulative rate (expected arrivals by time t), then the points of a
unit-rate renewal process mapped through Lambda^-1 are arrivals with rate lambda(t)
(Poisson when the unit process is Poisson). With gamma gaps (mean 1, coefficient of
variation `cv`) the same code makes burstier (cv > 1) or smoother (cv < 1) arrivals
around the same rate curve; BurstGPT reports gamma-distributed gaps.
"""
from __future__ import annotations

from collections.abc import Callable

import numpy as np

RateFn = Callable[[np.ndarray], np.ndarray]  # vectorized: times (s) -> requests per second
MAX_GRID_POINTS = 2_000_000


def unit_renewal_points(rng: np.random.Generator, total: float, cv: float = 1.0) -> np.ndarray:
    """Points of a unit-rate renewal process in [0, total): gamma gaps with mean 1."""
    if cv <= 0:
        raise ValueError(f"cv must be > 0, got {cv}")
    if total <= 0:
        return np.empty(0)
    shape, scale = 1.0 / (cv * cv), cv * cv
    chunks: list[np.ndarray] = []
    reached = 0.0
    while reached < total:
        n = int((total - reached) * 1.05 + 10 * np.sqrt(total - reached) + 64)
        gaps = rng.exponential(1.0, n) if cv == 1.0 else rng.gamma(shape, scale, n)
        pts = reached + np.cumsum(gaps)
        chunks.append(pts)
        reached = float(pts[-1])
    points = np.concatenate(chunks)
    return points[points < total]


def arrivals(rng: np.random.Generator, rate_fn: RateFn, duration_s: float, *, dt: float | None = None,
             cv: float = 1.0) -> np.ndarray:
    """Sorted arrival times in [0, duration_s) for the rate curve `rate_fn`."""
    if duration_s <= 0:
        raise ValueError(f"duration must be > 0, got {duration_s}")
    if dt is None:
        dt = min(1.0, duration_s / 10_000)
    dt = max(dt, duration_s / MAX_GRID_POINTS)
    grid = np.linspace(0.0, duration_s, int(np.ceil(duration_s / dt)) + 1)
    rate = np.asarray(rate_fn(grid), dtype=np.float64)
    if np.any(rate < 0) or not np.all(np.isfinite(rate)):
        raise ValueError("the rate must be finite and >= 0 everywhere")
    cumulative = np.concatenate(([0.0], np.cumsum((rate[1:] + rate[:-1]) * 0.5 * np.diff(grid))))
    points = unit_renewal_points(rng, float(cumulative[-1]), cv)
    return np.interp(points, cumulative, grid)


def constant_rate(rate: float) -> RateFn:
    if rate <= 0:
        raise ValueError(f"rate must be > 0, got {rate}")
    return lambda t: np.full_like(t, rate, dtype=np.float64)
