"""`tidal repro caraserve`: CaraServe's scheduler study (§7.5, Fig. 19) in the simulator.

The MAF-derived trace (every one of ~40,000 functions an adapter of mixed rank, Zipf popularity,
~340 RPS aggregate, bursty arrivals) is routed over 60 simulated Llama-2-7B/A10 servers by rank-aware
(ours: Alg. 1 plus the new request's own cost), rank-aware-strict (Alg. 1 as published), MostIdle,
Random and FirstFit -- the live policy code (shared/policy/lora_routing.py, routing.py)
-- with each LoRA kernel (padded BGMV, segmented MBGMV). Each server's step time is the same
linear model the router uses (loadgen/sim/lora_worker.py). A cold adapter's first use on a server
loads it from host memory inside the step that admits it (the one movement cost model: its bytes
from rank and Llama-2-7B's q/k/v geometry over the profile's PCIe link). SLO: time per token at
1.5x the HF-PEFT level (merged weights: no LoRA kernel, an unloaded server), the router's SLO too.

Arrivals: gamma gaps with coefficient of variation `arrival_cv` (MAF's bursts; 1 = Poisson). The
MAF trace is not in the library: 2.0 is OUR ASSUMPTION, between the Azure LLM inference trace's
conversation stream (CV 1.09) and its code stream (CV 13.2), both measured here
(tidal/bench/lora_stats.MAF_CV).

The cold-start experiment (§7.2, one server, Cached / OnDemand / S-LoRA / async / CaraServe) is
loadgen/repro/caraserve_cold.py; `run_repro` runs it after the routing study.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import msgspec
import numpy as np

from loadgen.report.metrics import summarize_records
from loadgen.report.records import RequestRecord
from loadgen.repro.caraserve_setting import (ADAPTER_GEOMETRY, ALPACA_OUTPUT, ALPACA_PROMPT,  # re-exported
                                             LORA_PROFILE, MAF_CV, MODEL)
from loadgen.sim.lora_worker import adapter_load_times, lora_worker_factory
from loadgen.sim.profile import CostProfile, load_profile
from loadgen.sim.simulator import Simulator
from loadgen.traces.arrivals import arrivals, constant_rate
from loadgen.traces.build import make_trace
from loadgen.traces.lengths import QuantileLengths
from loadgen.traces.maf import zipf_probabilities
from loadgen.traces.schema import AdapterInfo, MAFParams, Trace, TraceHeader, TraceRecord
from shared.lora_profile_file import load_lora_profile
from shared.policy.lora_perf_model import KERNELS, Kernel, LoraPerfProfile
from shared.policy.lora_routing import RankAware, RoutingOptions
from shared.policy.routing_policies import make_policy

POLICIES = ("rank-aware", "rank-aware-strict", "most-idle", "random", "first-fit")


@dataclass(frozen=True)
class CaraConfig:
    servers: int = 60
    adapters: int = 40_000
    rate: float = 340.0
    duration_s: float = 300.0  # the paper runs each workload for 5 minutes (§7.1)
    zipf_s: float = 1.0
    ranks: tuple[int, ...] = (8, 16, 32, 64)
    slo_factor: float = 1.5
    seed: int = 0
    kernels: tuple[str, ...] = KERNELS
    policies: tuple[str, ...] = POLICIES
    arrival_cv: float = MAF_CV
    cold_workloads: tuple[str, ...] = ("synthetic-r64-3rps", "synthetic-r64-4.5rps", "synthetic-r64-6rps",
                                       "synthetic-r64-7.5rps", "synthetic-r64", "synthetic-r32", "maf-128", "maf-256",
                                       "maf-512")
    cold_seeds: tuple[int, ...] = (0, 1, 2)
    cold_links: tuple[str, ...] = ("pcie-peak", "paper-effective")
    cold_duration_s: float = 300.0  # §7.1: 5 minutes per workload


SCALES: dict[str, CaraConfig] = {
    "paper": CaraConfig(),
    "tiny": CaraConfig(servers=4, adapters=400, rate=24.0, duration_s=20.0, cold_duration_s=20.0),
}


def build_trace(cfg: CaraConfig) -> Trace:
    """MAF-like: Poisson arrivals at `rate`, each request for an adapter drawn by Zipf popularity."""
    rng = np.random.default_rng(cfg.seed)
    width = len(str(cfg.adapters - 1))
    names = [f"fn-{j:0{width}d}" for j in range(cfg.adapters)]
    popularity = rng.permutation(cfg.adapters)
    ranks = rng.choice(np.asarray(cfg.ranks), cfg.adapters)
    infos = [AdapterInfo(name=names[j], model=MODEL, rank=int(ranks[j])) for j in range(cfg.adapters)]
    times = arrivals(rng, constant_rate(cfg.rate), cfg.duration_s, cv=cfg.arrival_cv)
    n = len(times)
    picked = popularity[rng.choice(cfg.adapters, n, p=zipf_probabilities(cfg.adapters, cfg.zipf_s))]
    prompts = QuantileLengths(ALPACA_PROMPT).sample(rng, n)
    outputs = QuantileLengths(ALPACA_OUTPUT).sample(rng, n)
    params = MAFParams(seed=cfg.seed, duration_s=cfg.duration_s, rate=cfg.rate, adapters=cfg.adapters,
                       zipf_s=cfg.zipf_s, models=[MODEL], ranks=list(cfg.ranks))
    return make_trace(params, cfg.duration_s, times, [MODEL], np.zeros(n, np.int64), prompts, outputs,
                      names, picked, infos)


def hf_peft_tpot(profile: CostProfile, lora: LoraPerfProfile, trace: Trace, sample: int = 50) -> float:
    """HF-PEFT's time per token: the adapter merged into the weights (no LoRA kernel: rank 0, the
    faster kernel's zero-rank limit), each request alone on a server. Median over a sample."""
    step = max(1, len(trace.records) // sample)
    picked = [TraceRecord(arrival_s=j * 1e5, model=r.model, prompt_tokens=r.prompt_tokens,
                          output_tokens=max(2, r.output_tokens), request_id=f"peft-{j}")
              for j, r in enumerate(trace.records[::step][:sample])]
    alone = Trace(header=TraceHeader(params=trace.header.params, num_records=len(picked),
                                     duration_s=len(picked) * 1e5), records=picked)
    kernel: Kernel = min(KERNELS, key=lambda k: lora.model(k).decode_s([0]))
    sim = Simulator(alone, profile, 1, make_policy("least-load"), max_run_s=1e5,
                    make_worker=lora_worker_factory(lora.model(kernel), {}))
    recs = sim.run().records
    return float(np.median([(r.finish_s - r.first_token_s) / (r.output_tokens - 1) for r in recs]))


class PolicyResult(msgspec.Struct, kw_only=True):
    kernel: str
    policy: str
    requests: int
    slo_attainment: float
    tpot_mean_s: float
    tpot_p50_s: float
    tpot_p99_s: float
    ttft_p50_s: float
    wall_s: float
    adapter_loads: int = 0  # cold adapters loaded onto a server
    adapter_load_s: float = 0.0  # the steps' total wait for those loads
    slo_penalties: int = 0  # rank-aware: candidates priced with the SLO penalty
    tpots: list[float] = []  # per request, for the CDF plot


def tpots(records: list[RequestRecord]) -> np.ndarray:
    """Time per output token of each request; a failed request counts as infinitely slow."""
    out = []
    for r in records:
        if r.status != "ok" or r.first_token_s is None:
            out.append(float("inf"))
        elif r.output_tokens >= 2:
            out.append((r.finish_s - r.first_token_s) / (r.output_tokens - 1))
    return np.asarray(out)


def run_policy(trace: Trace, profile: CostProfile, lora: LoraPerfProfile, cfg: CaraConfig, kernel: Kernel,
               policy: str, slo_s: float) -> PolicyResult:
    started = time.perf_counter()
    ranks = {a.name: a.rank for a in trace.header.adapters}
    load_s = adapter_load_times(profile.movement_costs(), ADAPTER_GEOMETRY, ranks)
    # the router sees no adapter bytes in the simulator's views: it estimates a load of the mean rank
    mean_rank = round(float(np.mean(list(ranks.values())))) if ranks else 1
    cold_load_s = profile.movement_costs().load_s(ADAPTER_GEOMETRY.adapter_bytes(max(1, mean_rank)),
                                                  in_host_memory=True)
    options = RoutingOptions(profile=lora, kernel=kernel, tpot_slo_s=slo_s,
                             avg_response_tokens=ALPACA_OUTPUT.mean, cold_load_s=cold_load_s)
    if policy == "rank-aware-strict":
        router = RankAware.from_options(options, strict=True)
    else:
        router = make_policy(policy, cfg.seed, options)
    sim = Simulator(trace, profile, cfg.servers, router,
                    make_worker=lora_worker_factory(lora.model(kernel), ranks, load_s))
    result = sim.run()
    records = result.records
    t = tpots(records)
    finite = t[np.isfinite(t)]
    summary = summarize_records(records, per_model=False)
    return PolicyResult(kernel=kernel, policy=policy, requests=len(records),
                        slo_attainment=float(np.mean(t <= slo_s)) if len(t) else 0.0,
                        tpot_mean_s=float(finite.mean()), tpot_p50_s=float(np.percentile(finite, 50)),
                        tpot_p99_s=float(np.percentile(finite, 99)),
                        ttft_p50_s=summary.ttft.p50 if summary.ttft else float("nan"),
                        wall_s=time.perf_counter() - started, adapter_loads=result.stats.adapter_loads,
                        adapter_load_s=sum(getattr(w, "adapter_load_total_s", 0.0) for w in sim.workers),
                        slo_penalties=getattr(router, "slo_penalties", 0), tpots=finite.tolist())


@dataclass
class CaraRun:
    cfg: CaraConfig
    trace: Trace
    slo_s: float
    peft_tpot_s: float
    results: dict[tuple[str, str], PolicyResult] = field(default_factory=dict)
    cold: list = field(default_factory=list)  # caraserve_cold.ColdRun per workload and link


def run_repro(cfg: CaraConfig, progress=None) -> CaraRun:
    profile = load_profile("a10-llama2-7b-lora")
    lora = load_lora_profile(LORA_PROFILE)
    trace = build_trace(cfg)
    peft = hf_peft_tpot(profile, lora, trace)
    run = CaraRun(cfg=cfg, trace=trace, slo_s=cfg.slo_factor * peft, peft_tpot_s=peft)
    for kernel in cfg.kernels:
        for policy in cfg.policies:
            res = run_policy(trace, profile, lora, cfg, kernel, policy, run.slo_s)  # type: ignore[arg-type]
            run.results[(kernel, policy)] = res
            if progress:
                progress(f"{kernel:9s} {policy:17s}: SLO attainment {res.slo_attainment:.3f}, mean TPOT "
                         f"{res.tpot_mean_s * 1000:.1f} ms ({len(trace.records)} requests, {res.wall_s:.1f} s)")
    if cfg.cold_workloads:
        from loadgen.repro.caraserve_cold import run_cold

        run.cold = run_cold(cfg.cold_workloads, cfg.cold_duration_s, cfg.cold_seeds, links=cfg.cold_links,
                            progress=progress)
    return run


@dataclass(frozen=True)
class Headline:
    kernel: str
    slo_attainment: float
    tpot_vs: dict[str, float]  # baseline -> rank-aware mean TPOT / baseline's - 1
    cold: str = ""  # the cold-start keys (synthetic rank 64, 6 RPS, the paper's effective link), when it ran

    def line(self) -> str:
        vs = " ".join(f"tpot_vs_{b.replace('-', '')}={round(100 * v):+d}%" for b, v in self.tpot_vs.items())
        return "repro caraserve: " + (f"{self.cold} " if self.cold else "") + f"slo_attainment={self.slo_attainment:.2f} {vs}"


def headline(run: CaraRun, kernel: str = "segmented") -> Headline:
    """Fig. 19-Top's figures (S-LoRA's MBGMV = segmented) unless only the other kernel ran."""
    if (kernel, "rank-aware") not in run.results:
        kernel = next(k for k, p in run.results if p == "rank-aware")
    ra = run.results[(kernel, "rank-aware")]
    vs = {b: ra.tpot_mean_s / run.results[(kernel, b)].tpot_mean_s - 1
          for b in ("most-idle", "random", "first-fit") if (kernel, b) in run.results}
    cold = ""
    from loadgen.repro.caraserve_cold import HEADLINE, cold_keys, pick

    if pick(run.cold, *HEADLINE):
        cold = cold_keys(run.cold)
    return Headline(kernel=kernel, slo_attainment=ra.slo_attainment, tpot_vs=vs, cold=cold)
