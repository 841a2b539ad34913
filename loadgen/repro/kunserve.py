"""`tidal repro kunserve`: KunServe §5 (Fig. 10, Fig. 16) in the buddy-group cluster simulator.

Qwen-2.5-14B on 8 simulated A800s over 200 Gbps RDMA (profile `a800-qwen2.5-14b`); BurstGPT-shaped
arrivals (a base rate with a burst) carrying BurstGPT, AzureConv and AGIEval-CoT lengths (KunServe
Table 2) at rising base rates; KunServe (drop plan: shared.policy.kunserve.plan_drop, monitor:
shared.policy.kunserve_monitor) against Llumnix (replication), Llumnix (w/ migration) and
Llumnix (pipeline) (loadgen/sim/buddy_cluster.py), and the Fig. 16 ablation: throughput-greedy vs
memory-greedy drop plans. SLOs are 5x the P50 TTFT and TBT of replication under a modest load.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import msgspec
import numpy as np

from loadgen.sim.buddy_cluster import SYSTEMS, BuddyCluster, ClusterConfig
from loadgen.sim.pipeline import PipelineCost
from loadgen.sim.profile import load_profile
from loadgen.sim.request import SimRequest
from loadgen.traces.burstgpt import generate_burstgpt
from loadgen.traces.schema import Burst, BurstGPTParams, Trace
from shared.profiles import load_pipeline_profile

MODEL = "qwen2.5-14b"
NUM_LAYERS = 48
LAYER_BYTES = 550_400_000  # see profiles/a800-qwen2.5-14b.toml
HIDDEN_BYTES = 5120 * 2
# Per stage per micro-batch overhead, calibrated to one published figure: a 2-stage pipeline serves
# 17.2% less than replication (KunServe §5.2: "12.6-21.8% lower in throughput", midpoint). With the
# profile's round time under load (~33 ms for a full 2-stage round), 2 x o / (33 ms + 2 x o) = 0.172
# gives o = 3.4 ms. The unloaded TBT factor this implies (~1.4x) is below the paper's 1.6-2.0x.
STAGE_OVERHEAD_S = 3.4e-3
LABELS = {"replication": "Llumnix (replication)", "migration": "Llumnix (w/ migration)",
          "pipeline": "Llumnix (pipeline)", "kunserve": "KunServe"}


@dataclass(frozen=True)
class KunConfig:
    datasets: tuple[str, ...] = ("burstgpt", "azureconv", "agieval-cot")
    # The operating point (§2.2 and §5.2): the base rate at which the KV provisioned is `kv_over_demand`
    # (2.1x, §2.2: "the overall HBM provisioned for KVCache is 2.1x higher than the average
    # requirement") the average KV demand over the trace -- in-processing plus queued requests'
    # KV, "a standard approach [45]" -- of Llumnix (replication), found by bisection on seed 0.
    # From there "continuously increase the request rate" (§5.2): these multiples of it.
    kv_over_demand: float = 2.1
    rate_steps: tuple[float, ...] = (1.0, 1.15, 1.3)
    seeds: tuple[int, ...] = (0, 1, 2)
    rates: dict[str, tuple[float, ...]] | None = None  # explicit base rates per dataset (skips the bisection)
    duration_s: float = 240.0
    burst_start_s: float = 60.0
    burst_s: float = 40.0
    # KunServe §2.2 on the BurstGPT trace it evaluates on (Fig. 1a): "the incoming request rate increases
    # by 14x at time 150s with no clear pattern". The burst's length (40 s) is not published: ours.
    burst_magnitude: float = 14.0
    slo_factor: float = 5.0
    instances: int = 8
    systems: tuple[str, ...] = SYSTEMS
    ablation: bool = True
    kv_blocks: int | None = None  # override the profile's KV budget per instance (the tiny scale: tight memory)

    @property
    def seed(self) -> int:
        return self.seeds[0]


SCALES: dict[str, KunConfig] = {
    "paper": KunConfig(),
    "tiny": KunConfig(datasets=("agieval-cot",), rate_steps=(1.0,), seeds=(0,), duration_s=40.0, burst_start_s=10.0,
                      burst_s=10.0, burst_magnitude=4.0, instances=4, kv_blocks=400),  # a tight-memory demo
}


def build_trace(cfg: KunConfig, dataset: str, rate: float, burst: bool = True, seed: int | None = None) -> Trace:
    bursts = [Burst(start_s=cfg.burst_start_s, duration_s=cfg.burst_s, magnitude=cfg.burst_magnitude)] if burst else []
    seed = cfg.seeds[0] if seed is None else seed
    return generate_burstgpt(BurstGPTParams(seed=seed, duration_s=cfg.duration_s, rate=rate, bursts=bursts,
                                            dataset=dataset, model=MODEL))  # type: ignore[arg-type]


class Point(msgspec.Struct, kw_only=True):
    dataset: str
    rate: float
    system: str
    seed: int = 0
    strategy: str = "throughput_greedy"
    requests: int
    ttft_p50: float
    ttft_p99: float
    tbt_p50: float
    tbt_p99: float
    slo_violation: float
    drops: int = 0
    migrations: int = 0
    migrations_failed: int = 0
    preemptions: int = 0
    kv_peak: float = 0.0  # the fullest any instance's KV got
    demand: float = 0.0  # mean KV demand (used + queued) / KV over the trace period
    waiting_memory_peak: int = 0  # most requests at once waiting for KV memory
    wall_s: float = 0.0


def _latencies(reqs: list[SimRequest]) -> tuple[np.ndarray, np.ndarray]:
    ok = [r for r in reqs if r.status == "ok" and r.first_token >= 0]
    ttft = np.array([r.first_token - r.arrival for r in ok])
    tbt = np.array([(r.finish - r.first_token) / (r.output - 1) if r.output > 1 else 0.0 for r in ok])
    return ttft, tbt


def simulate(cfg: KunConfig, trace: Trace, system: str, strategy: str = "throughput_greedy") -> tuple[list[SimRequest], BuddyCluster]:
    profile = load_profile("a800-qwen2.5-14b")
    if cfg.kv_blocks is not None:
        profile = msgspec.structs.replace(profile, worker=msgspec.structs.replace(profile.worker, kv_blocks=cfg.kv_blocks))
    pipe = PipelineCost(stage_overhead_s=STAGE_OVERHEAD_S, activation_bytes=HIDDEN_BYTES * 256, num_layers=NUM_LAYERS)
    cluster = BuddyCluster(trace, profile, load_pipeline_profile(), pipe,
                           ClusterConfig(system=system, instances=cfg.instances, strategy=strategy), NUM_LAYERS, LAYER_BYTES)
    return cluster.run(), cluster


def mean_demand(cluster: BuddyCluster, until_s: float) -> float:
    samples = [s.demand for s in cluster.samples if s.t_s <= until_s]
    return float(np.mean(samples)) if samples else 0.0


def point(cfg: KunConfig, trace: Trace, dataset: str, rate: float, system: str, slo: tuple[float, float],
          strategy: str = "throughput_greedy", seed: int = 0) -> Point:
    started = time.perf_counter()
    reqs, cluster = simulate(cfg, trace, system, strategy)
    ttft, tbt = _latencies(reqs)
    violated = (len(reqs) - len(ttft) + int(np.sum((ttft > slo[0]) | (tbt > slo[1])))) / max(1, len(reqs))
    return Point(dataset=dataset, rate=rate, system=system, seed=seed, strategy=strategy, requests=len(reqs),
                 ttft_p50=float(np.percentile(ttft, 50)), ttft_p99=float(np.percentile(ttft, 99)),
                 tbt_p50=float(np.percentile(tbt, 50)), tbt_p99=float(np.percentile(tbt, 99)),
                 slo_violation=violated, drops=cluster.drops, migrations=cluster.migrations,
                 migrations_failed=cluster.migration.failed, preemptions=cluster.preemptions,
                 kv_peak=cluster.kv_peak, demand=mean_demand(cluster, cfg.duration_s),
                 waiting_memory_peak=max((s.waiting_memory for s in cluster.samples), default=0),
                 wall_s=time.perf_counter() - started)


def operating_rate(cfg: KunConfig, dataset: str, iterations: int = 10) -> float:
    """The base rate at which replication's mean KV demand over the trace is 1 / kv_over_demand of
    its KV (bisection on the first seed; demand grows with the rate)."""
    target = 1.0 / cfg.kv_over_demand
    lo, hi = 0.05, 1.0
    while mean_demand(simulate(cfg, build_trace(cfg, dataset, hi), "replication")[1], cfg.duration_s) < target:
        lo, hi = hi, hi * 2
        if hi > 1e4:
            raise ValueError(f"{dataset}: no rate reaches a KV demand of {target:.0%}")
    for _ in range(iterations):
        mid = (lo + hi) / 2
        if mean_demand(simulate(cfg, build_trace(cfg, dataset, mid), "replication")[1], cfg.duration_s) < target:
            lo = mid
        else:
            hi = mid
    return round((lo + hi) / 2, 2)


@dataclass
class KunRun:
    cfg: KunConfig
    rates: dict[str, tuple[float, ...]] = field(default_factory=dict)  # dataset -> the sweep's base rates
    slos: dict[str, tuple[float, float]] = field(default_factory=dict)  # dataset -> (TTFT, TBT) seconds
    points: list[Point] = field(default_factory=list)
    ablation: list[Point] = field(default_factory=list)

    def get(self, dataset: str, rate: float, system: str, seed: int | None = None) -> Point:
        seed = self.cfg.seeds[0] if seed is None else seed
        return next(p for p in self.points if (p.dataset, p.rate, p.system, p.seed) == (dataset, rate, system, seed))


def sweep_rates(cfg: KunConfig, dataset: str) -> tuple[float, ...]:
    if cfg.rates is not None:
        return cfg.rates[dataset]
    base = operating_rate(cfg, dataset)
    return tuple(round(base * k, 2) for k in cfg.rate_steps)


def run_repro(cfg: KunConfig, progress=None) -> KunRun:
    run = KunRun(cfg)
    for dataset in cfg.datasets:
        rates = run.rates[dataset] = sweep_rates(cfg, dataset)
        if progress:
            progress(f"{dataset}: operating point {rates[0]:g} rps (KV = {cfg.kv_over_demand:g}x the mean demand), "
                     f"sweep {', '.join(f'{r:g}' for r in rates)} rps")
        modest, _ = simulate(cfg, build_trace(cfg, dataset, rates[0], burst=False), "replication")
        ttft, tbt = _latencies(modest)
        run.slos[dataset] = (cfg.slo_factor * float(np.median(ttft)), cfg.slo_factor * float(np.median(tbt)))
        for rate in rates:
            for seed in cfg.seeds:
                trace = build_trace(cfg, dataset, rate, seed=seed)
                for system in cfg.systems:
                    p = point(cfg, trace, dataset, rate, system, run.slos[dataset], seed=seed)
                    run.points.append(p)
                    if progress:
                        progress(f"{dataset} {rate:g} rps seed {seed} {system:11s}: P99 TTFT {p.ttft_p99:.2f} s, "
                                 f"P50 TBT {p.tbt_p50 * 1000:.1f} ms, KV peak {100 * p.kv_peak:.0f}%, "
                                 f"{p.preemptions} preemptions, {p.drops} drops, {p.migrations} migrations "
                                 f"({p.migrations_failed} failed), {p.wall_s:.1f} s")
    if cfg.ablation and "kunserve" in cfg.systems:
        dataset = "burstgpt" if "burstgpt" in cfg.datasets else cfg.datasets[0]
        rate = run.rates[dataset][-1]  # the highest rate: the one where the monitor drops
        trace = build_trace(cfg, dataset, rate)
        for strategy in ("throughput_greedy", "memory_greedy"):
            p = point(cfg, trace, dataset, rate, "kunserve", run.slos[dataset], strategy, seed=cfg.seeds[0])
            run.ablation.append(p)
            if progress:
                progress(f"ablation {dataset} {rate:g} rps {strategy}: P50/P99 TTFT {p.ttft_p50:.2f}/{p.ttft_p99:.2f} s")
    return run


@dataclass(frozen=True)
class Headline:
    ttft_vs: dict[str, float]  # baseline -> median over seeds of the sweep's best P99 TTFT ratio (baseline / KunServe)
    ttft_spread: dict[str, tuple[float, float]]  # baseline -> (min, max) of that best ratio over seeds
    best_point: dict[str, tuple[str, float, int]]  # baseline -> (dataset, rate, seed) of the median seed's best point
    tbt_vs_replication: float  # median over seeds of the worst P50 TBT ratio (KunServe / replication)
    seeds: int
    kv_peak_replication: float  # at the replication headline point
    preemptions_replication: int

    def line(self) -> str:
        ttft = " ".join(f"p99_ttft_vs_{b}={v:.1f}x" for b, v in self.ttft_vs.items())
        return (f"repro kunserve: {ttft} p50_tbt_vs_replication={self.tbt_vs_replication:.2f}x seeds={self.seeds} "
                f"kv_peak_replication={100 * self.kv_peak_replication:.0f}% "
                f"preemptions_replication={self.preemptions_replication}")


def headline(run: KunRun) -> Headline:
    """The paper's "up to": per seed, the best ratio over every dataset and rate of the sweep; then the
    median over seeds (and the spread). TBT: per seed the worst ratio; the median over seeds."""
    cfg = run.cfg
    grid = [(d, r) for d in cfg.datasets for r in run.rates[d]]
    ttft, spread, where = {}, {}, {}
    kv_peak, preempt = float("nan"), 0
    if "kunserve" in cfg.systems:
        for base in ("replication", "migration", "pipeline"):
            if base not in cfg.systems:
                continue
            best = []
            for seed in cfg.seeds:
                ratio, d, r = max((run.get(d, r, base, seed).ttft_p99 / run.get(d, r, "kunserve", seed).ttft_p99, d, r)
                                  for d, r in grid)
                best.append((ratio, d, r, seed))
            best.sort()
            median = best[len(best) // 2]
            ttft[base] = float(np.median([b[0] for b in best]))
            spread[base] = (best[0][0], best[-1][0])
            where[base] = (median[1], median[2], median[3])
            if base == "replication":
                p = run.get(median[1], median[2], "replication", median[3])
                kv_peak, preempt = p.kv_peak, p.preemptions
    tbt = float("nan")
    if {"kunserve", "replication"} <= set(cfg.systems):
        tbt = float(np.median([max(run.get(d, r, "kunserve", s).tbt_p50 / run.get(d, r, "replication", s).tbt_p50
                                   for d, r in grid) for s in cfg.seeds]))
    return Headline(ttft_vs=ttft, ttft_spread=spread, best_point=where, tbt_vs_replication=tbt, seeds=len(cfg.seeds),
                    kv_peak_replication=kv_peak, preemptions_replication=preempt)
