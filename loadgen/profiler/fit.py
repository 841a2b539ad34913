"""Fit the simulator's step cost (`loadgen/sim/profile.py` `StepCost`) to measured steps.

The model is linear in its five coefficients, so the fit is least squares on relative
error (each row divided by its measured time, so 2 ms decode steps count as much as 200 ms
prefills) with every coefficient kept >= 0: a small active-set loop drops the most negative
coefficient and refits until none is negative (the problem has five unknowns).
"""
from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from loadgen.profiler.measure import StepSample
from loadgen.sim.profile import StepCost

FIELDS = ("overhead_s", "decode_per_seq_s", "decode_per_ctx_token_s", "prefill_per_token_s", "prefill_attn_s")


def _design(samples: Sequence[StepSample]) -> tuple[np.ndarray, np.ndarray]:
    x = np.array([[1.0, s.decode_seqs, s.decode_ctx, s.prefill_tokens, s.prefill_attn] for s in samples])
    y = np.array([s.seconds for s in samples])
    return x, y


def fit_step_cost(samples: Sequence[StepSample]) -> StepCost:
    if len(samples) < 3:
        raise ValueError(f"need at least 3 measured steps to fit, got {len(samples)}")
    x, y = _design(samples)
    w = 1.0 / y
    xw, yw = x * w[:, None], y * w
    active = [j for j in range(x.shape[1]) if np.any(x[:, j])]  # columns never exercised stay 0
    coef = np.zeros(x.shape[1])
    while active:
        sol, *_ = np.linalg.lstsq(xw[:, active], yw, rcond=None)
        if (sol >= 0).all():
            coef[:] = 0
            coef[active] = sol
            break
        active.pop(int(np.argmin(sol)))
    if coef[0] <= 0 and coef.sum() <= 0:
        coef[0] = float(np.min(y))  # degenerate: at least a constant step
    return StepCost(**{name: float(v) for name, v in zip(FIELDS, coef)})


def fit_error(cost: StepCost, samples: Sequence[StepSample]) -> tuple[float, float]:
    """(median, max) relative error of the fitted model over the samples."""
    errs = [abs(cost.step_s(s.decode_seqs, s.decode_ctx, s.prefill_tokens, s.prefill_attn) - s.seconds) / s.seconds
            for s in samples]
    return float(np.median(errs)), float(np.max(errs))


__all__ = ["FIELDS", "fit_error", "fit_step_cost"]
