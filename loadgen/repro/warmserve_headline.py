"""The headline of `tidal repro warmserve`: seeds as a distribution, over the points where WarmServe meets its SLO.

A point is one workload at one RPS, replayed on every seed. Its ratio to a baseline (the baseline's P99
TTFT over WarmServe's) is a distribution over the seeds: the median and the range. The headline takes
only the points where WarmServe keeps its P99 TTFT within the SLO on every seed: at a saturated point the
P99 is queueing, and one seed's ratio there can be 6x while the next seed's is 0.5x (issue 30). It never
takes a maximum over points. The paper-comparable baseline is SLLM-GPU with the engine pool (the public
code pre-creates engines unless every prewarm is disabled); SLLM-GPU without a pool is an ablation.
"""
from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from loadgen.repro.warmserve import Point, ReproConfig

BASELINES = ("SLLM-GPU+pool", "WarmServe-noproactive", "SLLM-GPU")  # the first is the paper-comparable one


def _ratio(a: float, b: float) -> float:
    return a / b if b > 0 else math.inf


@dataclass(frozen=True)
class Spread:
    median: float
    lo: float
    hi: float

    @classmethod
    def of(cls, values: list[float]) -> "Spread":
        if not values:
            return cls(math.nan, math.nan, math.nan)
        return cls(float(np.median(values)), float(min(values)), float(max(values)))

    def fmt(self, digits: int = 1) -> str:
        return f"{self.median:.{digits}f}x({self.lo:.{digits}f}–{self.hi:.{digits}f})"


def by_point(points: list["Point"]) -> dict[tuple[str, float], list["Point"]]:
    """(workload, RPS) -> that point's runs, one per seed, in seed order."""
    out: dict[tuple[str, float], list["Point"]] = defaultdict(list)
    for p in sorted(points, key=lambda p: (p.workload.key, p.rps, p.seed)):
        out[(p.workload.key, p.rps)].append(p)
    return dict(out)


def within_slo(runs: list["Point"], slo_s: float, system: str = "WarmServe") -> bool:
    """The system keeps its P99 TTFT within the SLO on every seed of the point."""
    return all(p.results[system].p99_ttft <= slo_s for p in runs)


def ratios(runs: list["Point"], baseline: str) -> list[float]:
    """Per seed: the baseline's P99 TTFT over WarmServe's."""
    return [_ratio(p.results[baseline].p99_ttft, p.results["WarmServe"].p99_ttft) for p in runs]


def capacity(points: list["Point"], system: str, workload: str, slo_s: float) -> float:
    """The highest RPS of the sweep up to which the system keeps P99 TTFT within the SLO on every seed (0: none)."""
    best = 0.0
    for (key, rps), runs in sorted(by_point(points).items(), key=lambda kv: kv[0][1]):
        if key != workload:
            continue
        if not within_slo(runs, slo_s, system):
            break
        best = rps
    return best


def _hit(runs: list["Point"], system: str) -> float:
    return float(np.median([p.results[system].hit_rate for p in runs]))


@dataclass(frozen=True)
class Headline:
    seeds: int
    points: int  # workload x RPS
    within_slo_points: int  # of them, where WarmServe meets the SLO on every seed
    # baseline -> over the within-SLO points: the median of the per-point medians, and the range over every seed
    vs: dict[str, Spread]
    # the same over every point, saturated ones included (for the report only, never the headline)
    vs_all_points: dict[str, Spread]
    alg1_hit_gain: float  # median over within-SLO points: hit rate, WarmServe-noproactive - SLLM-GPU+pool
    proactive_hit_gain: float  # ... WarmServe - WarmServe-noproactive
    prewarm_hit: float  # WarmServe's median hit rate at the highest RPS
    cold_in_p99: int  # WarmServe, base seed: starts not on a prewarmed replica that delayed a request into the P99
    capacity_vs_muxserve: float  # highest RPS within the SLO, WarmServe over MuxServe (max over workloads)
    slo_s: float = 5.0
    per_point: list[dict] = field(default_factory=list)  # workload, rps, within_slo, baseline -> Spread

    def line(self) -> str:
        pct = (lambda x: "nan" if math.isnan(x) else f"{x * 100:+.0f}%")
        return (f"repro warmserve: p99_ttft_vs_sllm_pool={self.vs['SLLM-GPU+pool'].fmt()} "
                f"p99_ttft_vs_no_proactive={self.vs['WarmServe-noproactive'].fmt()} "
                f"p99_ttft_vs_sllm={self.vs['SLLM-GPU'].median:.1f}x "
                f"alg1_hit_gain={pct(self.alg1_hit_gain)} proactive_hit_gain={pct(self.proactive_hit_gain)} "
                f"seeds={self.seeds} within_slo_points={self.within_slo_points}/{self.points}")


def _summarise(groups: list[list["Point"]], baseline: str) -> Spread:
    if not groups:
        return Spread.of([])
    medians = [float(np.median(ratios(runs, baseline))) for runs in groups]
    every = [r for runs in groups for r in ratios(runs, baseline)]
    return Spread(float(np.median(medians)), min(every), max(every))


def headline(points: list["Point"], cfg: "ReproConfig") -> Headline:
    slo = cfg.slo_p99_ttft_s
    groups = by_point(points)
    calm = [runs for runs in groups.values() if within_slo(runs, slo)]
    top = max(rps for _, rps in groups)
    hits = [_hit(runs, "WarmServe") for (_, rps), runs in groups.items() if rps == top]
    caps = [_ratio(capacity(points, "WarmServe", k, slo), capacity(points, "MuxServe", k, slo))
            for k in cfg.workloads if any(key == k for key, _ in groups)]
    gain = (lambda a, b: float(np.median([_hit(r, a) - _hit(r, b) for r in calm])) if calm else math.nan)
    per_point = [{"workload": k, "rps": rps, "within_slo": within_slo(runs, slo),
                  **{b: Spread.of(ratios(runs, b)) for b in BASELINES}} for (k, rps), runs in groups.items()]
    seeds = len({p.seed for p in points})
    return Headline(
        seeds, len(groups), len(calm), {b: _summarise(calm, b) for b in BASELINES},
        {b: _summarise(list(groups.values()), b) for b in BASELINES},
        gain("WarmServe-noproactive", "SLLM-GPU+pool"), gain("WarmServe", "WarmServe-noproactive"),
        float(np.mean(hits)), sum(p.results["WarmServe"].cold_in_p99 for p in points if p.seed == cfg.seed),
        max(caps, default=math.nan), slo, per_point)
