"""The economy repro's bookkeeping on hand-made results: metrics, the best single arm, the headline ratios,
the report and its figures (the simulator itself is tested in test_economy_sim.py)."""
from __future__ import annotations

import json
import math

import numpy as np
import pytest

from loadgen.repro.economy import ArmMetrics, Point, best_single, best_single_overall, headline
from loadgen.repro.economy_report import write_economy_report
from loadgen.repro.economy_setup import EconomyConfig
from loadgen.sim.economy_result import ARMS, EconomyResult, PoolSample, PurchaseRecord


def result(arm: str, ttft: list[float], purchases: int = 0) -> EconomyResult:
    t = np.array(ttft, dtype=float)
    pool = [PoolSample(t=float(s), gpu=g, weights=10, prewarm=2, adapter=1, kv_used=5, kv_free=2)
            for s in range(0, 120, 5) for g in range(2)]
    buys = [PurchaseRecord(t=float(10 * k), scope="gpu:0", source=("prewarm", "migrate")[k % 2], target=f"x{k}",
                           bytes=1 << 20, price_request_s=0.1 * k) for k in range(purchases)]
    return EconomyResult(arm=arm, gpus=2, models=["m"], model=np.zeros(t.size, dtype=np.int64), ttft=t,
                         tpot=np.full(t.size, 0.02), unloaded_ttft=np.full(t.size, 0.1), purchases=buys, pool=pool,
                         counts={"preemptions": 3}, arrival=np.arange(t.size) * 1800.0 / max(1, t.size),
                         preempted=np.zeros(t.size, np.int64))


CFG = EconomyConfig(rates=(10.0,), headline_rate=10.0, seeds=(0, 1), slo_scale=5.0, slo_floor_s=0.0, phase_s=600.0)


def point(seed: int, p99: dict[str, float]) -> Point:
    p = Point(rate=10.0, seed=seed, gpus=2)
    for arm in ARMS:
        # 100 requests: 98 fast, 2 at the arm's tail value -> its P99 is that value
        r = result(arm, [0.1] * 98 + [p99[arm]] * 2, purchases=4 if arm == "arbiter" else 0)
        r.counts["autoscaler_starts"] = 5  # the base's starts: counted apart, never as purchases
        p.results[arm] = ArmMetrics.of(r, CFG, wall_s=1.0)
    return p


def test_metrics_count_slo_failures_and_purchases_by_source():
    r = result("arbiter", [0.1, 0.4, 0.6, math.nan], purchases=3)
    m = ArmMetrics.of(r, CFG, wall_s=2.0)
    assert m.failed == 1 and m.requests == 4
    assert m.slo == pytest.approx(2 / 4)  # SLO 5 x 0.1 s: 0.1 and 0.4 meet it, 0.6 and the failed one miss
    assert m.by_source == {"prewarm": 2, "migrate": 1} and m.purchases == 3


def test_headline_takes_the_best_single_per_point_and_medians_over_seeds():
    base = {"kunserve": 8.0, "mell": 6.0, "caraserve": 9.0, "warmserve": 7.0, "fixed-order": 5.0, "arbiter": 2.0,
            "unbounded": 1.0}
    other = dict(base, mell=12.0, warmserve=4.0, arbiter=4.0)  # seed 1: warmserve is best, ratio 1.0
    points = [point(0, base), point(1, other)]
    assert best_single(points[0]) == "mell" and best_single(points[1]) == "warmserve"
    # chosen once: the lowest median P99 over the seeds (warmserve 5.5 < kunserve 8 < mell 9 < caraserve 9)
    assert best_single_overall(points) == "warmserve"
    head = headline(points, CFG, {"arbiter": 10, "warmserve": 16})
    assert head.best_single == "warmserve"
    assert head.p99_vs_best_single == pytest.approx(np.median([7.0 / 2.0, 4.0 / 4.0]), rel=1e-6)
    assert head.p99_vs_hindsight == pytest.approx(np.median([6.0 / 2.0, 4.0 / 4.0]), rel=1e-6)
    assert head.gpus_vs_best_single == pytest.approx(10 / 16 - 1)
    assert head.p99_vs_fixed_order == pytest.approx(np.median([5.0 / 2.0, 5.0 / 4.0]), rel=1e-6)
    assert head.purchases == 8
    assert head.lower_bound_gap == pytest.approx(np.median([2.0, 4.0]), rel=1e-6)
    line = head.line()
    assert line.startswith("repro economy: p99_ttft_vs_best_single=2.2x(1.0–3.5) p99_ttft_vs_fixed_order=1.9x ")
    assert line.endswith("own_purchases=8 applied=n/a seeds=2") and head.autoscaler_starts == 10


def test_gpus_ratio_is_negative_when_the_arbiter_needs_fewer():
    base = dict.fromkeys(ARMS, 2.0)
    head = headline([point(0, base)], CFG, {"arbiter": 12, "kunserve": 16})
    assert head.best_single == "kunserve"  # ties go to the first single arm
    assert head.gpus_vs_best_single == pytest.approx(-0.25)
    assert "gpus_vs_best_single=-25%" in head.line()
    assert "gpus_vs_best_single=n/a" in headline([point(0, base)], CFG, {"arbiter": None}).line()


def test_report_writes_markdown_figures_and_summary(tmp_path):
    base = {"kunserve": 8.0, "mell": 6.0, "caraserve": 9.0, "warmserve": 7.0, "fixed-order": 5.0, "arbiter": 2.0,
            "unbounded": 1.0}
    points = [point(0, base)]
    head = headline(points, CFG, {})
    full = {arm: result(arm, [0.1, 0.2, 0.3], purchases=5) for arm in ARMS}
    path = write_economy_report(tmp_path, points, CFG, head, full, command="tidal repro economy", wall_s=1.0)
    text = path.read_text()
    assert head.line() in text and "| 10 | 0 | arbiter |" in text
    for png in ("p99_ttft.png", "slo_attainment.png", "pool_by_kind.png", "purchases.png", "ttft_cdf.png"):
        assert (tmp_path / png).stat().st_size > 1000, png
        assert f"]({png})" in text
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["line"] == head.line() and summary["points"][0]["results"]["arbiter"]["purchases"] == 4


def test_worst_phase_compares_the_arbiter_with_the_best_single_in_each_phase_and_applied_counts_outcomes():
    from loadgen.repro.economy import worst_phase

    def arm_result(arm: str, tails: tuple[float, float, float], counts: dict[str, int]) -> ArmMetrics:
        ttft = []
        for tail in tails:  # 100 requests per phase, the last two at the phase's tail
            ttft += [0.1] * 98 + [tail] * 2
        r = result(arm, ttft)
        r.counts.update(counts)
        return ArmMetrics.of(r, CFG, wall_s=1.0)

    p = Point(rate=10.0, seed=0, gpus=2)
    tails = {"kunserve": (1.0, 8.0, 3.0), "mell": (2.0, 4.0, 6.0), "caraserve": (3.0, 9.0, 9.0),
             "warmserve": (3.0, 9.0, 9.0), "fixed-order": (5.0, 5.0, 5.0), "unbounded": (0.5, 0.5, 0.5)}
    for arm, t in tails.items():
        p.results[arm] = arm_result(arm, t, {})
    # the arbiter: 2 s in phase 0 (kunserve had 1 s there: 0.5x), 2 s and 1 s later
    p.results["arbiter"] = arm_result("arbiter", (2.0, 2.0, 1.0), {"bought": 10, "applied": 9, "refused": 1,
                                                                  "failed_migrations": 1})
    assert [ph.p99_ttft for ph in p.results["arbiter"].phases] == pytest.approx([2.0, 2.0, 1.0])
    assert worst_phase(p) == pytest.approx(0.5)
    head = headline([p], CFG, {})
    assert head.worst_phase_vs_best_single == pytest.approx(0.5)
    assert head.applied == pytest.approx(0.8)  # 9 applied at once, 1 of them failed in flight, of 10 bought
    assert "worst_phase_vs_best_single=0.5x" in head.line() and "applied=80% seeds=1" in head.line()
