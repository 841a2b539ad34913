"""The economy repro's hindsight oracles (loadgen/repro/economy_oracle.py) on hand-made per-request TTFTs:
each request's best among the single arms or every memory-bounded arm, and a per-phase switch between the single
arms; then the headline's median of the best single over each, and the report's section."""
from __future__ import annotations

import math

import numpy as np
import pytest

from loadgen.repro.economy import ArmMetrics, Point, headline
from loadgen.repro.economy_oracle import hindsight_oracles
from loadgen.repro.economy_report import write_economy_report
from loadgen.sim.economy_result import ARMS
from tests.loadgen.test_repro_economy_report import CFG, result


def arms_with(tails: dict[str, tuple[float, float]]) -> dict[str, np.ndarray]:
    """Two phases of 100 requests; in each, the arm's two slowest requests at the phase's tail value and at
    different positions per arm, so the per-request best differs from every arm."""
    out = {}
    for i, (arm, (a, b)) in enumerate(tails.items()):
        t = np.full(200, 0.1)
        t[[i, i + 10]] = a
        t[[100 + i, 110 + i]] = b
        out[arm] = t
    return out


def test_the_per_request_best_takes_each_requests_lowest_ttft_and_the_switch_each_phases_best_arm():
    ttfts = arms_with({"kunserve": (1.0, 9.0), "mell": (5.0, 2.0), "caraserve": (6.0, 6.0), "warmserve": (6.0, 6.0),
                       "fixed-order": (7.0, 7.0), "arbiter": (3.0, 3.0), "unbounded": (0.0, 0.0)})
    phase = np.repeat([0, 1], 100)
    got = hindsight_oracles(ttfts, phase)
    # every arm's tail falls on its own requests, where the others give 0.1 s: the per-request best is 0.1 s flat
    assert got["request-best-single"] == pytest.approx(0.1)
    assert got["request-best-bounded"] == pytest.approx(0.1)
    # the switch: kunserve's phase 0 (1 s at its 2 slow requests), mell's phase 1 (2 s): P99 of 200 requests
    # with 2 at 1 s and 2 at 2 s
    expect = np.percentile(np.r_[np.full(196, 0.1), [1.0, 1.0, 2.0, 2.0]], 99)
    assert got["phase-switch"] == pytest.approx(expect)
    assert "phase-switch" not in hindsight_oracles(ttfts, None)


def test_a_request_slow_in_every_arm_stays_slow_and_one_failed_in_every_arm_is_left_out():
    t = {a: np.r_[np.full(98, 0.1), [4.0 + k, math.nan]] for k, a in enumerate(("mell", "kunserve", "arbiter"))}
    got = hindsight_oracles(t, None)
    assert got["request-best-single"] == pytest.approx(np.percentile(np.r_[np.full(98, 0.1), [4.0]], 99))
    with pytest.raises(ValueError, match="different traces"):
        hindsight_oracles({"mell": np.zeros(3), "arbiter": np.zeros(4)}, None)


def test_the_headline_and_report_set_the_best_single_against_each_oracle(tmp_path):
    p = Point(rate=10.0, seed=0, gpus=2)
    for arm, tail in {"kunserve": 8.0, "mell": 6.0, "caraserve": 9.0, "warmserve": 7.0, "fixed-order": 5.0,
                      "arbiter": 4.0, "unbounded": 1.0}.items():
        p.results[arm] = ArmMetrics.of(result(arm, [0.1] * 98 + [tail] * 2), CFG, wall_s=1.0)
    p.oracles = {"request-best-single": 3.0, "request-best-bounded": 2.0}
    head = headline([p], CFG, {})
    assert head.best_single == "mell"
    assert head.oracle_vs_best_single == pytest.approx({"request-best-single": 2.0, "request-best-bounded": 3.0})
    text = write_economy_report(tmp_path, [p], CFG, head, {a: result(a, [0.1, 0.2]) for a in ARMS},
                                command="tidal repro economy", wall_s=1.0, plots=False).read_text()
    assert "## Hindsight oracles" in text and "| 0 | 6.00 | 4.00 | 3.00 | 2.00 | 1.00 |" in text
