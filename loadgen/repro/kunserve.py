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
    # Base rates (cluster rps outside the burst). KunServe §5.1 scales the BurstGPT trace "to fit our
    # cluster" without publishing the rates (Fig. 10's axes only), so they are ours: each point keeps
    # the peak rate (base x burst) of our earlier 4x-burst points (12/16/20, 8/11/14, 30/40/50 rps),
    # i.e. the old rates x 4/14, now that the burst has the paper's 14x ratio.
    datasets: dict[str, tuple[float, ...]] = field(default_factory=lambda: {
        "burstgpt": (3.4, 4.6, 5.7), "azureconv": (2.3, 3.1, 4.0), "agieval-cot": (8.6, 11.4, 14.3)})
    duration_s: float = 240.0
    burst_start_s: float = 60.0
    burst_s: float = 40.0
    # KunServe §2.2 on the BurstGPT trace it evaluates on (Fig. 1a): "the incoming request rate increases
    # by 14x at time 150s with no clear pattern". The burst's length (40 s) is not published: ours.
    burst_magnitude: float = 14.0
    slo_factor: float = 5.0
    instances: int = 8
    seed: int = 0
    systems: tuple[str, ...] = SYSTEMS
    ablation: bool = True
    kv_blocks: int | None = None  # override the profile's KV budget per instance (the tiny scale: tight memory)


SCALES: dict[str, KunConfig] = {
    "paper": KunConfig(),
    "tiny": KunConfig(datasets={"agieval-cot": (2.0,)}, duration_s=40.0, burst_start_s=10.0, burst_s=10.0,
                      burst_magnitude=4.0, instances=4, kv_blocks=400),  # a tight-memory demo, not §5's setting
}


def build_trace(cfg: KunConfig, dataset: str, rate: float, burst: bool = True) -> Trace:
    bursts = [Burst(start_s=cfg.burst_start_s, duration_s=cfg.burst_s, magnitude=cfg.burst_magnitude)] if burst else []
    return generate_burstgpt(BurstGPTParams(seed=cfg.seed, duration_s=cfg.duration_s, rate=rate, bursts=bursts,
                                            dataset=dataset, model=MODEL))  # type: ignore[arg-type]


class Point(msgspec.Struct, kw_only=True):
    dataset: str
    rate: float
    system: str
    strategy: str = "throughput_greedy"
    requests: int
    ttft_p50: float
    ttft_p99: float
    tbt_p50: float
    tbt_p99: float
    slo_violation: float
    drops: int = 0
    migrations: int = 0
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


def point(cfg: KunConfig, trace: Trace, dataset: str, rate: float, system: str, slo: tuple[float, float],
          strategy: str = "throughput_greedy") -> Point:
    started = time.perf_counter()
    reqs, cluster = simulate(cfg, trace, system, strategy)
    ttft, tbt = _latencies(reqs)
    violated = (len(reqs) - len(ttft) + int(np.sum((ttft > slo[0]) | (tbt > slo[1])))) / max(1, len(reqs))
    return Point(dataset=dataset, rate=rate, system=system, strategy=strategy, requests=len(reqs),
                 ttft_p50=float(np.percentile(ttft, 50)), ttft_p99=float(np.percentile(ttft, 99)),
                 tbt_p50=float(np.percentile(tbt, 50)), tbt_p99=float(np.percentile(tbt, 99)),
                 slo_violation=violated, drops=cluster.drops, migrations=cluster.migrations,
                 wall_s=time.perf_counter() - started)


@dataclass
class KunRun:
    cfg: KunConfig
    slos: dict[str, tuple[float, float]] = field(default_factory=dict)  # dataset -> (TTFT, TBT) seconds
    points: list[Point] = field(default_factory=list)
    ablation: list[Point] = field(default_factory=list)

    def get(self, dataset: str, rate: float, system: str) -> Point:
        return next(p for p in self.points if (p.dataset, p.rate, p.system) == (dataset, rate, system))


def run_repro(cfg: KunConfig, progress=None) -> KunRun:
    run = KunRun(cfg)
    for dataset, rates in cfg.datasets.items():
        modest, _ = simulate(cfg, build_trace(cfg, dataset, rates[0], burst=False), "replication")
        ttft, tbt = _latencies(modest)
        run.slos[dataset] = (cfg.slo_factor * float(np.median(ttft)), cfg.slo_factor * float(np.median(tbt)))
        for rate in rates:
            trace = build_trace(cfg, dataset, rate)
            for system in cfg.systems:
                p = point(cfg, trace, dataset, rate, system, run.slos[dataset])
                run.points.append(p)
                if progress:
                    progress(f"{dataset} {rate:g} rps {system:11s}: P99 TTFT {p.ttft_p99:.2f} s, P50 TBT "
                             f"{p.tbt_p50 * 1000:.1f} ms, SLO violations {100 * p.slo_violation:.1f}% "
                             f"({p.requests} requests, {p.drops} drops, {p.migrations} migrations, {p.wall_s:.1f} s)")
    if cfg.ablation and "kunserve" in cfg.systems:
        dataset = "burstgpt" if "burstgpt" in cfg.datasets else next(iter(cfg.datasets))
        rates = cfg.datasets[dataset]
        rate = rates[-1]  # the highest rate: the one where the monitor drops
        trace = build_trace(cfg, dataset, rate)
        for strategy in ("throughput_greedy", "memory_greedy"):
            p = point(cfg, trace, dataset, rate, "kunserve", run.slos[dataset], strategy)
            run.ablation.append(p)
            if progress:
                progress(f"ablation {dataset} {rate:g} rps {strategy}: P50/P99 TTFT {p.ttft_p50:.2f}/{p.ttft_p99:.2f} s")
    return run


@dataclass(frozen=True)
class Headline:
    ttft_vs: dict[str, float]  # baseline -> its P99 TTFT / KunServe's (highest rate, best dataset)
    tbt_vs_replication: float  # KunServe's P50 TBT / replication's (highest rate, worst dataset)

    def line(self) -> str:
        ttft = " ".join(f"p99_ttft_vs_{b}={v:.1f}x" for b, v in self.ttft_vs.items())
        return f"repro kunserve: {ttft} p50_tbt_vs_replication={self.tbt_vs_replication:.2f}x"


def headline(run: KunRun) -> Headline:
    """At each dataset's highest rate: the best TTFT ratio over datasets ("up to", as the paper
    states it) and the worst TBT ratio."""
    tops = [(d, rates[-1]) for d, rates in run.cfg.datasets.items()]
    ttft = {}
    for base in ("replication", "migration", "pipeline"):
        if base in run.cfg.systems and "kunserve" in run.cfg.systems:
            ttft[base] = max(run.get(d, r, base).ttft_p99 / run.get(d, r, "kunserve").ttft_p99 for d, r in tops)
    tbt = max((run.get(d, r, "kunserve").tbt_p50 / run.get(d, r, "replication").tbt_p50 for d, r in tops),
              default=float("nan")) if {"kunserve", "replication"} <= set(run.cfg.systems) else float("nan")
    return Headline(ttft_vs=ttft, tbt_vs_replication=tbt)
