"""MELL request classes (§VI-C boundaries) and the §VII weights (Table I, Lemma 2.1)."""
from __future__ import annotations

from fractions import Fraction

import pytest

from shared.policy.mell import MellScheduler, request_class
from shared.policy.mell_classes import WEIGHT, WEIGHT_COMBINED_L, WEIGHT_SINGLE_L

C = 2400  # divisible by 2, 3, 4 and 8: every boundary is an exact integer


@pytest.mark.parametrize(("size", "cls"), [
    (C, "L"), (C // 2 + 1, "L"),
    (C // 2, "M"), (C // 3 + 1, "M"),
    (C // 3, "S"), (C // 4 + 1, "S"),
    (C // 4, "T"), (C // 8 + 1, "T"),
    (C // 8, "tiny"), (1, "tiny"),
])
def test_class_boundaries_are_the_papers_half_open_intervals(size: int, cls: str) -> None:
    assert request_class(size, C) == cls


def test_boundaries_are_exact_when_c_is_not_divisible() -> None:
    # C = 100: L > 50, M > 33.3.., S > 25, T > 12.5
    assert [request_class(s, 100) for s in (51, 50, 34, 33, 26, 25, 13, 12)] == \
        ["L", "M", "M", "S", "S", "T", "T", "tiny"]


@pytest.mark.parametrize("size", [0, -5, C + 1])
def test_a_size_outside_zero_to_c_is_refused_with_its_value(size: int) -> None:
    with pytest.raises(ValueError, match=f"{size}"):
        request_class(size, C)


def test_table_one_weights() -> None:
    assert WEIGHT_SINGLE_L == 1 and WEIGHT_COMBINED_L == Fraction(5, 6)
    assert WEIGHT["M"] == Fraction(1, 2) and WEIGHT["S"] == Fraction(1, 3) and WEIGHT["T"] == 0
    # Table I: no bin of an optimal packing weighs more than 4/3 (so OPT >= 3/4 W(I))
    bins = {"LM": WEIGHT_COMBINED_L + WEIGHT["M"], "LS": WEIGHT_COMBINED_L + WEIGHT["S"],
            "MM": 2 * WEIGHT["M"], "MSS": WEIGHT["M"] + 2 * WEIGHT["S"], "SSS": 3 * WEIGHT["S"],
            "LTT": WEIGHT_SINGLE_L + 2 * WEIGHT["T"]}
    assert max(bins.values()) == Fraction(4, 3) == bins["LM"]


def test_weight_of_an_allocation_counts_single_and_combined_l() -> None:
    s = MellScheduler(C)
    s.allocate("l1", 1300)  # single L: 1
    s.allocate("l2", 1400)
    s.allocate("m", 900)  # joins an L-GPU: that L becomes combined (5/6) + M (1/2)
    s.allocate("s", 700)  # S: 1/3, joins the other L-GPU: combined
    s.allocate("t", 400)  # T: 0
    s.allocate("tiny", 10)  # tiny: 0
    assert s.weight_lower_bound() == pytest.approx(float(2 * WEIGHT_COMBINED_L + Fraction(1, 2) + Fraction(1, 3)))
    s.depart("s")  # l2's device keeps only its L (and T items): single again
    assert s.weight_lower_bound() == pytest.approx(float(Fraction(5, 6) + 1 + Fraction(1, 2)))
