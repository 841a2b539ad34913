"""Profiling-guided split of a layer's cold-adapter rows across CPU LoRA helpers (CaraServe §4.2).

Pure: no I/O, no clock. Each helper's throughput is measured (its start-up profile, then a
moving average of the compute seconds it reports per call); the planner gives each helper a
contiguous share of the rows proportional to its throughput, and uses only as many helpers
as the rows need (`min_rows` per helper: below that the round trip costs more than it saves,
the paper's "one core handles c tokens, use ceil(L/c) cores").
"""
from __future__ import annotations

import math

EWMA = 0.3  # weight of the newest measurement in a helper's throughput


def split_rows(total: int, throughputs: list[float], min_rows: int = 16) -> list[tuple[int, int, int]]:
    """(helper index, first row, row count) covering rows [0, total), in row order.

    `throughputs` (> 0 each) are the live helpers' measured speeds, any unit; helpers beyond
    ceil(total / min_rows) are left idle, the fastest kept."""
    if total < 0 or min_rows < 1:
        raise ValueError(f"split_rows: total {total} must be >= 0 and min_rows {min_rows} >= 1")
    if any(not (t > 0 and math.isfinite(t)) for t in throughputs):
        raise ValueError(f"split_rows: throughputs must be finite and > 0, got {throughputs}")
    if total == 0 or not throughputs:
        return []
    wanted = max(1, min(len(throughputs), math.ceil(total / min_rows)))
    chosen = sorted(sorted(range(len(throughputs)), key=lambda i: -throughputs[i])[:wanted])
    speed = sum(throughputs[i] for i in chosen)
    plan, start, acc = [], 0, 0.0
    for n, i in enumerate(chosen):
        acc += throughputs[i]
        end = total if n == len(chosen) - 1 else round(total * acc / speed)
        if end > start:
            plan.append((i, start, end - start))
        start = max(start, end)
    return plan


def updated_throughput(current: float, rows: int, rank: int, seconds: float) -> float:
    """A helper's throughput (row x rank products per second) after a call took `seconds`."""
    if rows <= 0 or seconds <= 0:
        return current
    measured = rows * max(rank, 1) / seconds
    return (1 - EWMA) * current + EWMA * measured
