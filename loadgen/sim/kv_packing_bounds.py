"""Lower bounds on the GPUs a KV-packing op stream needs (any policy, any number of free migrations).

At each planning boundary the live requests' KV sizes are a bin-packing instance with bins of KV
capacity C; no placement of them fits on fewer devices than its Martello-Toth L2 bound (Martello &
Toth, "Lower bounds and reduction procedures for the bin packing problem", Discrete Applied
Mathematics 28, 1990), which is at least L1 = ceil(sum / C):

    L2 = max over 0 <= a <= C/2 of  |J1| + |J2| + max(0, ceil((S(J3) - (|J2| C - S(J2))) / C))
    J1 = {s > C - a},  J2 = {C - a >= s > C/2},  J3 = {C/2 >= s >= a}

The peak over the boundaries is a lower bound on the peak GPUs (MELL's eq. 3) of every policy that
serves the stream as it comes (no request delayed). A policy that makes requests wait (a baseline
whose engine preempts them) serves a different, later stream and can go below it.
"""
from __future__ import annotations

import math

import numpy as np

from loadgen.sim.kv_packing import Schedule
from shared.policy.mell_ops import Depart


def l2_bound(sizes: np.ndarray | list[int], capacity: int) -> int:
    """Martello-Toth's L2 lower bound on the bins of capacity `capacity` that items `sizes` need."""
    w = np.sort(np.asarray(sizes, np.int64))
    if not len(w):
        return 0
    if w[-1] > capacity or w[0] <= 0:
        raise ValueError(f"item sizes must be in (0, {capacity}], got {int(w[0])}..{int(w[-1])}")
    C = int(capacity)
    prefix = np.concatenate(([0], np.cumsum(w)))
    n = len(w)
    half = int(np.searchsorted(w, C // 2, side="right"))  # items <= C/2 (integers: s <= floor(C/2)) come first
    n_large = n - half
    alphas = np.unique(np.concatenate(([0], w[:half])))
    # J1: s > C - a; J2: C/2 < s <= C - a; J3: a <= s <= C/2
    j1_start = np.searchsorted(w, C - alphas, side="right")
    j1 = n - j1_start
    j2 = np.maximum(0, j1_start - half)
    s2 = prefix[np.maximum(j1_start, half)] - prefix[half]
    j3_start = np.searchsorted(w, alphas, side="left")
    s3 = prefix[half] - prefix[np.minimum(j3_start, half)]
    extra = np.maximum(0, -((-(s3 - (j2 * C - s2))) // C))
    best = int((j1 + j2 + extra).max())
    l1 = math.ceil(int(prefix[-1]) / C)
    assert j1[0] + j2[0] == n_large
    return max(best, l1)


def peak_lower_bound(schedule: Schedule) -> tuple[int, int]:
    """(L1, L2): the peaks over the schedule's boundaries of the two bounds, on its undelayed stream."""
    C = schedule.capacity
    live: dict[str, int] = {}
    total = large = 0
    best_l1 = best_l2 = 0
    for ops in schedule.epochs:
        if not ops:
            continue
        for op in ops:
            if type(op) is Depart:
                s = live.pop(op.request_id)
                total -= s
                large -= 2 * s > C
            else:
                old = live.get(op.request_id, 0)
                s = op.size
                live[op.request_id] = s
                total += s - old
                large += (2 * s > C) - (2 * old > C)
        l1 = -(-total // C)
        best_l1 = max(best_l1, l1)
        if l1 + large > best_l2:  # L2 <= L1 + (items above C/2): only then can it beat the best so far
            best_l2 = max(best_l2, l2_bound(np.fromiter(live.values(), np.int64, len(live)), C))
    return best_l1, best_l2


__all__ = ["l2_bound", "peak_lower_bound"]
