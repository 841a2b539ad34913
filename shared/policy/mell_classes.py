"""MELL request classes and the §VII weights (pure arithmetic, no state).

Classes by KV size S against the per-device KV capacity C (MELL §VI-C):
L (C/2, C], M (C/3, C/2], S (C/4, C/3], T (C/8, C/4], and "tiny" <= C/8, which MELL groups
into multi-items (bundles) whose size lies in (C/8, C/4] and which then pack as T items.
The boundaries are compared in integers (2*S > C rather than S > C/2), so no rounding.
"""
from __future__ import annotations

from fractions import Fraction
from typing import Literal

RequestClass = Literal["L", "M", "S", "T", "tiny"]

# order of the classes, smallest first: a device's category is the class of its largest item
RANK: dict[str, int] = {"tiny": 0, "T": 1, "S": 2, "M": 3, "L": 4}

# Table I / Lemma 2.1 weights; an L-request is "combined" when an M/S-request shares its device
WEIGHT_SINGLE_L = Fraction(1)
WEIGHT_COMBINED_L = Fraction(5, 6)
WEIGHT: dict[str, Fraction] = {"M": Fraction(1, 2), "S": Fraction(1, 3), "T": Fraction(0), "tiny": Fraction(0)}

# how many requests of a class fill a device of that category (Theorem 1 properties 1 and 2)
FULL_COUNT: dict[str, int] = {"M": 2, "S": 3}


def check_capacity(capacity: int) -> int:
    if isinstance(capacity, bool) or not isinstance(capacity, int) or capacity < 8:
        raise ValueError(f"device capacity must be an integer >= 8 (units of KV), got {capacity!r}")
    return capacity


def check_size(size: int, capacity: int, what: str = "request size") -> int:
    if isinstance(size, bool) or not isinstance(size, int):
        raise ValueError(f"{what} must be an integer, got {size!r}")
    if size <= 0 or size > capacity:
        raise ValueError(f"{what} {size} is outside (0, C={capacity}]: a request must fit on one device")
    return size


def request_class(size: int, capacity: int) -> RequestClass:
    """L, M, S, T or tiny for a request of `size` on devices of KV capacity `capacity`."""
    check_capacity(capacity)
    check_size(size, capacity)
    if 2 * size > capacity:
        return "L"
    if 3 * size > capacity:
        return "M"
    if 4 * size > capacity:
        return "S"
    if 8 * size > capacity:
        return "T"
    return "tiny"


def at_least_three_quarters(used: int, capacity: int) -> bool:
    """Theorem 1 properties 3 and 5: memory utilisation >= 75%."""
    return 4 * used >= 3 * capacity
