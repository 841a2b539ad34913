"""The WarmServe headline: a median and range over seeds, over the points where WarmServe meets its SLO only."""
from __future__ import annotations

import dataclasses
from types import SimpleNamespace

from loadgen.repro.warmserve import SCALES
from loadgen.repro.warmserve_headline import capacity, headline

CFG = dataclasses.replace(SCALES["tiny"], rps=(5.0, 25.0), seeds=3, slo_p99_ttft_s=5.0)


def _m(p99: float, hit: float = 0.5) -> SimpleNamespace:
    return SimpleNamespace(p99_ttft=p99, hit_rate=hit, cold_in_p99=0)


def _point(rps: float, seed: int, ws: float, pool: float, noproactive: float, bare: float,
           hits: tuple[float, float, float] = (0.9, 0.8, 0.5)) -> SimpleNamespace:
    results = {"WarmServe": _m(ws, hits[0]), "WarmServe-noproactive": _m(noproactive, hits[1]),
               "SLLM-GPU+pool": _m(pool, hits[2]), "SLLM-GPU": _m(bare, hits[2]), "MuxServe": _m(1.0)}
    return SimpleNamespace(workload=SimpleNamespace(key="conv-a0.5"), rps=rps, seed=seed, results=results)


def _points() -> list:
    calm = [_point(5.0, s, 1.0, pool, 1.0, 20.0) for s, pool in enumerate((1.0, 1.2, 1.4))]
    # saturated: WarmServe's P99 is queueing on one seed, and the ratios there swing wildly
    hot = [_point(25.0, 0, 2.0, 12.8, 6.2, 40.0), _point(25.0, 1, 30.0, 14.0, 13.0, 60.0),
           _point(25.0, 2, 4.0, 4.0, 1.0, 80.0)]
    return calm + hot


def test_the_headline_is_a_median_over_seeds_at_within_slo_points_never_a_max() -> None:
    head = headline(_points(), CFG)
    assert (head.seeds, head.points, head.within_slo_points) == (3, 2, 1)
    pool = head.vs["SLLM-GPU+pool"]
    assert (pool.median, pool.lo, pool.hi) == (1.2, 1.0, 1.4)  # the saturated point's 6.4x is not in it
    assert head.vs_all_points["SLLM-GPU+pool"].hi == 6.4  # reported apart, as all points
    assert head.vs["SLLM-GPU"].median == 20.0
    line = head.line()
    assert line.startswith("repro warmserve: p99_ttft_vs_sllm_pool=1.2x(1.0–1.4) ")
    assert line.endswith("seeds=3 within_slo_points=1/2")


def test_hit_gains_credit_alg1_and_proactive_prewarming_separately() -> None:
    head = headline(_points(), CFG)
    assert round(head.alg1_hit_gain, 6) == 0.3 and round(head.proactive_hit_gain, 6) == 0.1
    assert "alg1_hit_gain=+30% proactive_hit_gain=+10%" in head.line()


def test_capacity_needs_every_seed_within_the_slo() -> None:
    pts = _points()
    assert capacity(pts, "WarmServe", "conv-a0.5", 5.0) == 5.0  # seed 1 at 25 rps is over the SLO
    assert capacity(pts, "MuxServe", "conv-a0.5", 5.0) == 25.0
    assert capacity([p for p in pts if p.seed != 1], "WarmServe", "conv-a0.5", 5.0) == 25.0
