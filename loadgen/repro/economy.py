"""`tidal repro economy`: the memory arbiter against each mechanism alone and all four in the fixed
order, at equal GPUs, on the mixed trace, in the economy simulator (loadgen/sim/economy.py).

For every rate and seed, one mixed trace (loadgen/repro/economy_setup.py) is replayed on every arm
of loadgen/sim/economy_result.ARMS over the same GPUs. Per arm: P50/P99 TTFT, SLO attainment (TTFT
within max(slo_scale x the request's unloaded TTFT, slo_floor_s)), purchases by source. The headline
takes, at the headline rate, the median over seeds of each ratio; the best single mechanism is chosen
once, as a deployment would (the lowest median P99 TTFT over the seeds), and each seed's own best (in
hindsight) is reported beside it; then the fewest GPUs at which the arbiter and that best single
mechanism reach the SLO target (a sweep of GPU counts at the headline rate, first seed). `unbounded` is
the reference beside them: the same GPUs with memory never short (not a strict bound: its fleet's
start-ups differ).
"""
from __future__ import annotations

import math
import multiprocessing as mp
import time
from concurrent.futures import ProcessPoolExecutor, as_completed
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from loadgen.repro.economy_oracle import hindsight_oracles
from loadgen.repro.economy_phased import PHASES, phase_of
from loadgen.repro.economy_phases import PhaseMetrics, phase_metrics
from loadgen.repro.economy_setup import EconomyConfig, build_run
from loadgen.sim.economy_result import ARMS, SINGLE_ARMS, EconomyResult


@dataclass(frozen=True)
class ArmMetrics:
    p50_ttft: float
    p99_ttft: float
    slo: float  # attainment
    requests: int
    failed: int
    purchases: int
    by_source: dict[str, int]
    counts: dict[str, int]
    wall_s: float
    phases: list[PhaseMetrics] = field(default_factory=list)  # the phased trace's phases, in order

    @classmethod
    def of(cls, r: EconomyResult, cfg: EconomyConfig, wall_s: float) -> "ArmMetrics":
        ok = r.ttft[~np.isnan(r.ttft)]
        by_source: dict[str, int] = {}
        for p in r.purchases:
            by_source[p.source] = by_source.get(p.source, 0) + 1
        phases = phase_metrics(r, [p.name for p in PHASES], cfg.phase_s, cfg.slo_scale, cfg.slo_floor_s) \
            if cfg.trace == "phased" else []
        return cls(float(np.percentile(ok, 50)) if ok.size else math.nan, r.p99_ttft(),
                   r.slo_attainment(cfg.slo_scale, cfg.slo_floor_s), int(r.ttft.size), int(np.isnan(r.ttft).sum()),
                   len(r.purchases), by_source, dict(r.counts), wall_s, phases)


@dataclass
class Point:
    rate: float
    seed: int
    gpus: int
    results: dict[str, ArmMetrics] = field(default_factory=dict)
    wall_s: float = 0.0  # every arm on this trace
    oracles: dict[str, float] = field(default_factory=dict)  # hindsight oracles' P99 TTFT (economy_oracle)


def ratio(a: float, b: float) -> float:
    return a / b if b > 0 else math.inf


def best_single(point: Point, key: str = "p99_ttft") -> str:
    """The single mechanism with the lowest P99 TTFT at this point, in hindsight (ties: the first in SINGLE_ARMS)."""
    singles = [a for a in SINGLE_ARMS if a in point.results]
    return min(singles, key=lambda a: (getattr(point.results[a], key), SINGLE_ARMS.index(a)))


def best_single_overall(points: list[Point]) -> str:
    """The single mechanism a deployment would pick: the lowest median P99 TTFT over these points (seeds),
    chosen once for all of them (ties: the first in SINGLE_ARMS)."""
    singles = [a for a in SINGLE_ARMS if all(a in p.results for p in points)]
    return min(singles, key=lambda a: (float(np.median([p.results[a].p99_ttft for p in points])),
                                       SINGLE_ARMS.index(a)))


def run_point(cfg: EconomyConfig, rate: float, seed: int, *, gpus: int | None = None,
              arms: tuple[str, ...] | None = None, keep: dict[str, EconomyResult] | None = None) -> Point:
    """Every arm on one trace; `keep` (if given) receives the full results (for the plots)."""
    run = build_run(cfg, rate, seed)
    n = gpus or run.profile.fleet.gpus
    point = Point(rate, seed, n)
    ttfts: dict[str, np.ndarray] = {}
    arrival = np.zeros(0)
    for arm in arms or cfg.arms:
        started = time.perf_counter()
        result = run.simulate(arm, n)
        point.results[arm] = ArmMetrics.of(result, cfg, time.perf_counter() - started)
        ttfts[arm], arrival = result.ttft, result.arrival  # every arm replays the same requests
        if keep is not None:
            keep[arm] = result
    phase = phase_of(arrival, cfg.phase_s, len(PHASES)) if cfg.trace == "phased" else None
    point.oracles = hindsight_oracles(ttfts, phase)
    return point


def gpus_needed(cfg: EconomyConfig, arm: str, rate: float, seed: int) -> int | None:
    """The fewest GPUs of cfg.gpu_sweep at which `arm` reaches the SLO target (None: not even the most)."""
    run = build_run(cfg, rate, seed)
    for n in sorted(cfg.gpu_sweep):
        if run.simulate(arm, n).slo_attainment(cfg.slo_scale, cfg.slo_floor_s) >= cfg.slo_target:
            return n
    return None


def worst_phase(point: Point) -> float:
    """The arbiter's worst phase against the best single mechanism *in that phase*: min over the phases of
    (that phase's lowest single-arm P99 TTFT / the arbiter's there); below 1: a phase where it is worse."""
    arb = point.results["arbiter"].phases
    singles = [point.results[a].phases for a in SINGLE_ARMS if a in point.results]
    if not arb or not singles:
        return math.nan
    return min(ratio(min(s[k].p99_ttft for s in singles), arb[k].p99_ttft) for k in range(len(arb)))


@dataclass(frozen=True)
class Headline:
    # median over seeds at the headline rate of the best single mechanism's P99 TTFT / the arbiter's, the best
    # single chosen once (lowest median P99 over the seeds), and its range over the seeds;
    # `p99_vs_hindsight`: each seed's own best single
    p99_vs_best_single: float
    p99_vs_fixed_order: float
    slo_attainment: float  # the arbiter's, median over seeds at the headline rate
    gpus_vs_best_single: float  # (arbiter's GPUs - best single's) / best single's, at the SLO target; NaN: unknown
    purchases: int  # the arbiter's own (not the autoscaler's starts), summed over the headline rate's seeds
    best_single: str  # the single mechanism most often best at the headline rate
    lower_bound_gap: float  # median: the arbiter's P99 TTFT / the unbounded-memory reference's
    gpus: dict[str, int | None] = field(default_factory=dict)
    p99_vs_hindsight: float = math.nan
    autoscaler_starts: int = 0  # the shared autoscaler's starts in the arbiter's runs: the base, not purchases
    p99_vs_best_single_range: tuple[float, float] = (math.nan, math.nan)  # over the seeds
    worst_phase_vs_best_single: float = math.nan  # median over seeds of `worst_phase`
    applied: float = math.nan  # the arbiter's purchases applied / bought (the rest refused or failed in flight)
    seeds: int = 0
    # median over seeds of the best single's P99 TTFT / each hindsight oracle's (economy_oracle): what any mix of
    # the memory-bounded arms' outcomes could reach against the goal
    oracle_vs_best_single: dict[str, float] = field(default_factory=dict)

    def line(self) -> str:
        g = "n/a" if math.isnan(self.gpus_vs_best_single) else f"{self.gpus_vs_best_single * 100:+.0f}%"
        lo, hi = self.p99_vs_best_single_range
        a = "n/a" if math.isnan(self.applied) else f"{self.applied * 100:.0f}%"
        return (f"repro economy: p99_ttft_vs_best_single={self.p99_vs_best_single:.1f}x({lo:.1f}–{hi:.1f}) "
                f"p99_ttft_vs_fixed_order={self.p99_vs_fixed_order:.1f}x "
                f"worst_phase_vs_best_single={self.worst_phase_vs_best_single:.1f}x "
                f"gpus_vs_best_single={g} own_purchases={self.purchases} applied={a} seeds={self.seeds}")


def headline(points: list[Point], cfg: EconomyConfig, gpus: dict[str, int | None]) -> Headline:
    at = [p for p in points if p.rate == cfg.headline_rate] or points
    best = best_single_overall(at)
    vs_best = [ratio(p.results[best].p99_ttft, p.results["arbiter"].p99_ttft) for p in at]
    hindsight = [ratio(p.results[best_single(p)].p99_ttft, p.results["arbiter"].p99_ttft) for p in at]
    vs_fixed = [ratio(p.results["fixed-order"].p99_ttft, p.results["arbiter"].p99_ttft) for p in at]
    gap = [ratio(p.results["arbiter"].p99_ttft, p.results["unbounded"].p99_ttft)
           for p in at if "unbounded" in p.results]
    g_arb, g_best = gpus.get("arbiter"), gpus.get(best)
    g_ratio = (g_arb - g_best) / g_best if g_arb is not None and g_best else math.nan
    worst = [w for w in (worst_phase(p) for p in at) if not math.isnan(w)]
    counts = [p.results["arbiter"].counts for p in at]
    bought = sum(c.get("bought", 0) for c in counts)
    applied = sum(c.get("applied", 0) - c.get("failed_migrations", 0) for c in counts)
    oracles = {k: float(np.median([ratio(p.results[best].p99_ttft, p.oracles[k]) for p in at]))
               for k in (at[0].oracles if at else {}) if all(k in p.oracles for p in at)}
    return Headline(float(np.median(vs_best)), float(np.median(vs_fixed)),
                    float(np.median([p.results["arbiter"].slo for p in at])), g_ratio,
                    sum(p.results["arbiter"].purchases for p in at), best,
                    float(np.median(gap)) if gap else math.nan, dict(gpus), float(np.median(hindsight)),
                    sum(c.get("autoscaler_starts", 0) for c in counts), (min(vs_best), max(vs_best)),
                    float(np.median(worst)) if worst else math.nan, applied / bought if bought else math.nan,
                    len({p.seed for p in at}), oracles)


def _point_task(cfg: EconomyConfig, rate: float, seed: int, full: bool) -> tuple[Point, dict[str, EconomyResult] | None]:
    keep: dict[str, EconomyResult] | None = {} if full else None
    started = time.perf_counter()
    p = run_point(cfg, rate, seed, keep=keep)
    p.wall_s = time.perf_counter() - started
    return p, keep


def _gpus_task(cfg: EconomyConfig, arm: str) -> int | None:
    return gpus_needed(cfg, arm, cfg.headline_rate, cfg.seeds[0])


def run_repro(cfg: EconomyConfig, progress: Callable[[str], None] = lambda line: None,
              keep: dict[str, EconomyResult] | None = None, jobs: int = 1,
              checkpoint: Callable[[Point], None] = lambda point: None) -> tuple[list[Point], dict[str, int | None]]:
    """The sweep (rates x seeds, every arm), then the GPU sweep at the headline rate for the arbiter and
    the single mechanism best there. `keep` gets the headline rate's first seed's full results. `jobs`: points
    (one trace, every arm) run over that many processes; the simulator is deterministic, so the figures are
    the same at any `jobs`. `checkpoint` gets each point as it ends (a run cut short keeps them)."""
    if jobs < 1:
        raise ValueError(f"economy repro: jobs must be >= 1, got {jobs}")
    tasks = [(rate, seed, keep is not None and rate == cfg.headline_rate and seed == cfg.seeds[0])
             for rate in cfg.rates for seed in cfg.seeds]

    def done(p: Point, full: dict[str, EconomyResult] | None) -> Point:
        if full is not None and keep is not None:
            keep.update(full)
        cells = " ".join(f"{a}={m.p99_ttft:.2f}s" for a, m in p.results.items())
        progress(f"rate={p.rate:g} seed={p.seed}: p99 ttft {cells} ({p.wall_s:.0f}s)")
        checkpoint(p)
        return p

    if jobs == 1:
        points = [done(*_point_task(cfg, *t)) for t in tasks]
    else:
        # the headline rate's points first (a run cut short has them), each reported as it ends
        first = sorted(tasks, key=lambda t: t[0] != cfg.headline_rate)
        with ProcessPoolExecutor(max_workers=jobs, mp_context=mp.get_context("spawn")) as pool:
            futures = [pool.submit(_point_task, cfg, *t) for t in first]
            got = [done(*f.result()) for f in as_completed(futures)]
        points = sorted(got, key=lambda p: (cfg.rates.index(p.rate), cfg.seeds.index(p.seed)))
    gpus: dict[str, int | None] = {}
    if cfg.gpu_sweep:
        best = best_single_overall([p for p in points if p.rate == cfg.headline_rate] or points)
        arms = ("arbiter", best)
        if jobs == 1:
            found = [_gpus_task(cfg, a) for a in arms]
        else:
            with ProcessPoolExecutor(max_workers=min(jobs, 2), mp_context=mp.get_context("spawn")) as pool:
                found = list(pool.map(_gpus_task, [cfg] * 2, arms))
        for arm, n in zip(arms, found):
            gpus[arm] = n
            progress(f"gpus for SLO attainment >= {cfg.slo_target:.2f} at rate {cfg.headline_rate:g}: {arm} "
                     f"{n if n is not None else 'more than ' + str(max(cfg.gpu_sweep))}")
    return points, gpus


__all__ = ["ARMS", "ArmMetrics", "Headline", "Point", "best_single", "best_single_overall", "gpus_needed", "headline",
           "ratio", "run_point", "run_repro", "worst_phase"]
