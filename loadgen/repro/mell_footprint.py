"""Final KV footprints for the hindsight arms of `tidal repro mell` (BF-reserve and WF-reserve reserve
a request's final size at admission, which no scheduler knows; see shared/policy/binpack_baselines.py).

The footprint of a request is the largest size the op stream ever gives it: its prompt +
output KV rounded up to a granule, as of the last planning boundary it is alive at (at most
one interval of decode tokens short of the very last token, which is almost always inside the
same granule). It comes from the same op stream every policy replays, so a reservation is
never outgrown.
"""
from __future__ import annotations

import numpy as np

from loadgen.sim.kv_packing import Schedule
from shared.policy.mell_ops import Allocate, Depart, Update


def final_sizes(schedule: Schedule) -> dict[str, int]:
    """Request id -> the largest KV size (bytes) the schedule allocates or updates it to."""
    final: dict[str, int] = {}
    for ops in schedule.epochs:
        for op in ops:
            if type(op) is Allocate or type(op) is Update:
                if op.size > final.get(op.request_id, 0):
                    final[op.request_id] = op.size
    return final


def reserved_bytes(schedule: Schedule, final: dict[str, int]) -> np.ndarray:
    """Per epoch: the bytes a reserving policy holds after the batch (every live request's
    footprint); policy-independent, like `schedule.used_bytes`."""
    out = np.zeros(len(schedule.epochs), np.int64)
    held = 0
    for e, ops in enumerate(schedule.epochs):
        for op in ops:
            if type(op) is Allocate:
                held += final[op.request_id]
            elif type(op) is Depart:
                held -= final[op.request_id]
        out[e] = held
    return out
