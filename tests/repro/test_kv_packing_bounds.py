"""The lower bound beside every scenario of `tidal repro mell` (loadgen/sim/kv_packing_bounds.py):
Martello-Toth's L2 never exceeds the optimal number of bins and is at least L1."""
from __future__ import annotations

import math

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from loadgen.sim.kv_packing import build_schedule
from loadgen.sim.kv_packing_bounds import l2_bound, peak_lower_bound


def optimum(items: list[int], capacity: int) -> int:
    """Fewest bins by exhaustive search (small instances)."""
    items = sorted(items, reverse=True)
    for k in range(1, len(items) + 1):
        bins = [0] * k

        def place(i: int) -> bool:
            if i == len(items):
                return True
            tried = set()
            for b in range(k):
                if bins[b] + items[i] <= capacity and bins[b] not in tried:
                    tried.add(bins[b])
                    bins[b] += items[i]
                    if place(i + 1):
                        return True
                    bins[b] -= items[i]
            return False

        if place(0):
            return k
    return 0


@settings(max_examples=400, deadline=None)
@given(st.integers(8, 60).flatmap(lambda c: st.tuples(st.just(c), st.lists(st.integers(1, c), min_size=1,
                                                                            max_size=8))))
def test_l2_is_a_lower_bound_at_least_l1(case) -> None:
    capacity, items = case
    bound = l2_bound(items, capacity)
    assert math.ceil(sum(items) / capacity) <= bound <= optimum(items, capacity)


def test_l2_counts_what_l1_misses() -> None:
    assert l2_bound([60, 60, 60], 100) == 3  # L1 says 2: no two items above C/2 share a bin
    assert l2_bound([60, 45, 45], 100) == 2  # 45 + 45 fit together beside nothing else
    assert l2_bound([70, 70, 30, 30, 30], 100) == 3
    assert l2_bound([], 100) == 0


def test_the_peak_bound_follows_the_op_stream() -> None:
    # three requests above C/2 at once: their KV (about 190 B) would fit two 100 B devices, they need three
    s = build_schedule(np.array([0.1, 0.2, 0.3]), np.array([60, 60, 60]), np.array([5, 5, 5]), capacity=100,
                       bytes_per_token=1, granule_tokens=1, epoch_s=1.0, prefill_s_per_token=0.0, decode_step_s=1.0)
    assert peak_lower_bound(s) == (2, 3)
    # two that never outgrow one device together (at most 88 B): one
    s = build_schedule(np.array([0.1, 20.1]), np.array([30, 20]), np.array([30, 25]), capacity=100,
                       bytes_per_token=1, granule_tokens=1, epoch_s=1.0, prefill_s_per_token=0.0, decode_step_s=1.0)
    assert peak_lower_bound(s) == (1, 1)
