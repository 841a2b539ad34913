"""MELL §VII as checks on a live allocation: the weight W(I) and Theorem 1's five properties.

Exempt, as the "constant number of exceptions": the most recently activated M-GPU (it may hold
one M-request and be under 75%), S-GPU (fewer than three S-requests) and T-GPU (under 75%).
Property 4 uses Fig. 10's fit test for an M/S-request joining an L-GPU: S_L + S_i <= C (T items
on the L-GPU would be moved off).
"""
from __future__ import annotations

from fractions import Fraction

from shared.policy.mell_classes import FULL_COUNT, WEIGHT, WEIGHT_COMBINED_L, WEIGHT_SINGLE_L, at_least_three_quarters
from shared.policy.mell_fleet import Fleet


def total_weight(fleet: Fleet) -> Fraction:
    """W(I): single L 1, combined L 5/6, M 1/2, S 1/3, T and tiny 0 (Table I / Lemma 2.1)."""
    w = Fraction(0)
    for dev in fleet.active.values():
        n_l, n_m, n_s = dev.counts["L"], dev.counts["M"], dev.counts["S"]
        w += n_l * (WEIGHT_COMBINED_L if n_m or n_s else WEIGHT_SINGLE_L)
        w += n_m * WEIGHT["M"] + n_s * WEIGHT["S"]
    return w


def violations(fleet: Fleet) -> list[str]:
    cap = fleet.capacity
    out: list[str] = []
    latest = {cat: fleet.latest(cat) for cat in ("M", "S", "T")}
    for dev in fleet.active.values():
        if dev.used > cap:
            out.append(f"Eq. 2: {dev.id} holds {dev.used} > C={cap}")
    for cat, prop in (("M", 1), ("S", 2)):
        for dev in fleet.of_category(cat):
            if dev is not latest[cat] and dev.counts[cat] != FULL_COUNT[cat]:
                out.append(f"property {prop}: {cat}-GPU {dev.id} holds {dev.counts[cat]} {cat}-requests, "
                           f"not {FULL_COUNT[cat]}")
    for dev in fleet.of_category("T"):
        if dev is not latest["T"] and not at_least_three_quarters(dev.used, cap):
            out.append(f"property 3: T-GPU {dev.id} is {dev.used / cap:.0%} used (< 75%)")
    smallest_sm = min((it.size for cat in ("M", "S") for dev in fleet.of_category(cat)
                       for it in dev.items.values() if it.cls in ("M", "S")), default=None)
    for dev in fleet.of_category("L"):
        large = dev.large()
        if (smallest_sm is not None and large is not None and not (dev.counts["M"] or dev.counts["S"])
                and large.size + smallest_sm <= cap):
            out.append(f"property 4: L-GPU {dev.id} holds no M/S-request, yet one of size {smallest_sm} "
                       f"on an M/S-GPU fits beside its L-request of {large.size}")
    if fleet.count("T"):
        for cat in ("L", "M"):
            for dev in fleet.of_category(cat):
                if dev is not latest["M"] and not at_least_three_quarters(dev.used, cap):
                    out.append(f"property 5: T-GPUs exist but {cat}-GPU {dev.id} is {dev.used / cap:.0%} used")
    return out
