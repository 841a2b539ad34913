"""`tidal repro warmserve`: WarmServe's end-to-end evaluation (§7.3, Figs. 9, 11, 13-15) simulated.

For every workload (AzureConv alpha 0.5 and 2.0, AzureCode alpha 0.5) and rising RPS, one
trace is replayed in the fleet simulator (loadgen/sim/fleet.py) on four systems over the same
16 GPUs: WarmServe (CSP forecasts -> Eqs. 5-8 -> Alg. 1, proactive prewarming into grace-period
KV up to Eq. 1's target), WarmServe without proactive prewarming, SLLM-GPU (on-demand scaling,
checkpoints from host memory, stopped instances' weights kept on their GPUs) and MuxServe
(static co-location). The headline compares P99 TTFT (the baseline's over WarmServe's).
"""
from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from loadgen.repro.warmserve_setup import MUXSERVE_MESHES, WORKLOADS, Workload, build_trace, forecasts, systems
from loadgen.sim.fleet import FleetResult, FleetSim
from loadgen.sim.fleet_muxserve import muxserve_instances
from loadgen.sim.fleet_profile import FleetProfile, load_fleet_profile
from loadgen.sim.fleet_state import FleetSystem
from loadgen.traces.azure import power_law_shares

SYSTEMS = ("WarmServe", "WarmServe-noproactive", "SLLM-GPU", "MuxServe")


@dataclass(frozen=True)
class ReproConfig:
    profile: str = "warmserve-h800-llama2"
    day_s: float = 3600.0  # one compressed day per run
    window_s: float = 300.0  # the paper's 5-minute prediction window
    history_days: int = 3  # earlier days the CSP's seasonal term averages
    rps: tuple[float, ...] = (5.0, 10.0, 15.0, 20.0, 25.0)
    workloads: tuple[str, ...] = tuple(WORKLOADS)
    keep_alive_s: float = 30.0
    slo_p99_ttft_s: float = 5.0  # "can serve": P99 TTFT within this (for the MuxServe capacity ratio)
    seed: int = 0


SCALES: dict[str, ReproConfig] = {
    "paper": ReproConfig(),
    "tiny": ReproConfig(day_s=600.0, window_s=60.0, history_days=2, rps=(4.0, 12.0), workloads=("conv-a0.5",),
                        keep_alive_s=15.0),
}


@dataclass(frozen=True)
class Metrics:
    requests: int
    served: int  # got a first token
    p50_ttft: float
    p95_ttft: float
    p99_ttft: float
    p50_tpot: float
    p99_tpot: float
    mean_tpot: float
    hit_rate: float
    starts: dict[str, int]
    prewarms: int
    proactive: int
    ttft: np.ndarray = field(repr=False, compare=False)
    tpot: np.ndarray = field(repr=False, compare=False)

    @classmethod
    def of(cls, r: FleetResult) -> "Metrics":
        ttft = np.where(np.isnan(r.ttft), np.inf, r.ttft)  # never served: worse than any latency
        tpot = r.tpot[~np.isnan(r.tpot)]
        q = (lambda a, p: float(np.quantile(a, p)) if len(a) else math.nan)
        return cls(len(ttft), int(np.isfinite(ttft).sum()), q(ttft, 0.5), q(ttft, 0.95), q(ttft, 0.99),
                   q(tpot, 0.5), q(tpot, 0.99), float(tpot.mean()) if len(tpot) else math.nan, r.hit_rate,
                   r.starts, r.prewarms, r.proactive, ttft, tpot)


@dataclass
class Point:
    workload: Workload
    rps: float
    results: dict[str, Metrics] = field(default_factory=dict)


def muxserve_system(profile: FleetProfile, w: Workload) -> FleetSystem:
    names = [m.name for m in profile.models]
    shares = dict(zip(names, power_law_shares(len(names), w.alpha).tolist()))
    static = muxserve_instances(profile, MUXSERVE_MESHES[w.alpha], shares)
    return FleetSystem("MuxServe", autoscale=False, cache_on_release=False, static=static)


def run_point(profile: FleetProfile, cfg: ReproConfig, w: Workload, rps: float,
              only: tuple[str, ...] = SYSTEMS) -> Point:
    trace = build_trace(profile, w, rps, cfg.day_s, cfg.seed)
    fc = forecasts(profile, w, trace, rps, cfg.day_s, cfg.window_s, cfg.history_days, cfg.seed)
    initial = {m.name: max(1, math.ceil(fc[m.name][0].avg / m.batch_size)) for m in profile.models}
    point = Point(w, rps)
    table = systems(cfg.keep_alive_s)
    for name in only:
        if name == "MuxServe":
            sim = FleetSim(profile, trace, muxserve_system(profile, w))
        else:
            sim = FleetSim(profile, trace, table[name], forecasts=fc, window_s=cfg.window_s, initial=initial)
        point.results[name] = Metrics.of(sim.run())
    return point


def run_repro(cfg: ReproConfig, progress: Callable[[str], None] = lambda line: None) -> list[Point]:
    profile = load_fleet_profile(cfg.profile)
    points = []
    for key in cfg.workloads:
        for rps in cfg.rps:
            started = time.perf_counter()
            p = run_point(profile, cfg, WORKLOADS[key], rps)
            points.append(p)
            cells = " ".join(f"{s}={m.p99_ttft:.2f}s" for s, m in p.results.items())
            progress(f"{key} rps={rps:g}: p99 ttft {cells} hit={p.results['WarmServe'].hit_rate:.0%} "
                     f"({time.perf_counter() - started:.1f}s)")
    return points


def _ratio(a: float, b: float) -> float:
    return a / b if b > 0 else math.inf


@dataclass(frozen=True)
class Headline:
    p99_vs_sllm: float  # max over points of SLLM-GPU's P99 TTFT over WarmServe's
    p99_vs_no_proactive: float
    prewarm_hit: float  # WarmServe's mean hit rate at the highest RPS
    capacity_vs_muxserve: float  # highest RPS within the SLO, WarmServe over MuxServe

    def line(self) -> str:
        return (f"repro warmserve: p99_ttft_vs_sllm={self.p99_vs_sllm:.1f}x "
                f"p99_ttft_vs_no_proactive={self.p99_vs_no_proactive:.1f}x prewarm_hit={self.prewarm_hit * 100:.0f}%")


def capacity(points: list[Point], system: str, workload: str, slo_s: float) -> float:
    """The highest RPS of the sweep up to which the system keeps P99 TTFT within the SLO (0: none)."""
    best = 0.0
    for p in sorted((p for p in points if p.workload.key == workload), key=lambda p: p.rps):
        if p.results[system].p99_ttft > slo_s:
            break
        best = p.rps
    return best


def headline(points: list[Point], cfg: ReproConfig) -> Headline:
    vs_sllm = max(_ratio(p.results["SLLM-GPU"].p99_ttft, p.results["WarmServe"].p99_ttft) for p in points)
    vs_np = max(_ratio(p.results["WarmServe-noproactive"].p99_ttft, p.results["WarmServe"].p99_ttft) for p in points)
    top = max(p.rps for p in points)
    hits = [p.results["WarmServe"].hit_rate for p in points if p.rps == top]
    caps = [_ratio(capacity(points, "WarmServe", k, cfg.slo_p99_ttft_s), capacity(points, "MuxServe", k, cfg.slo_p99_ttft_s))
            for k in cfg.workloads]
    return Headline(vs_sllm, vs_np, float(np.mean(hits)), max(caps))
