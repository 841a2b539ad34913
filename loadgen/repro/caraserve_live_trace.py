"""`tidal repro caraserve --live`'s pure half: the trace, the simulator's cost profile, the figures.

The trace (seeded): Poisson arrivals over `adapters` LoRA adapters of the small generated model,
ranks cycled over 8-64 and shuffled, popularity Zipf as in the MAF-derived trace of the paper
scale; prompts and outputs uniform in short ranges so a run takes seconds per policy on a CPU.
Every request names an adapter (the paper's workload has no base-model requests).

The simulator replays the same records with the same policy code, each worker's step costed by
the LoRA model measured on this host (`tidal profile lora` on the same checkpoint): a base
profile of zeros plus `LoraSimWorker`'s modelled step, so the sim and the router agree on what a
batch costs and the live run shows what the model leaves out (contention for the host's cores
between workers, gateway and client; the dispatcher's stats lag).
"""
from __future__ import annotations

import re
from dataclasses import dataclass

import msgspec
import numpy as np

from loadgen.report.records import RequestRecord
from loadgen.repro.caraserve import POLICIES as SIM_POLICIES
from loadgen.repro.caraserve import tpots

# the dispatcher's `routing_policy` names (strict Alg. 1 is a simulator-only arm)
POLICIES = tuple(p for p in SIM_POLICIES if p != "rank-aware-strict")
from loadgen.sim.profile import CostProfile, StepCost, WorkerSpec
from loadgen.traces.build import make_trace
from loadgen.traces.maf import zipf_probabilities
from loadgen.traces.schema import AdapterInfo, MAFParams, Trace

MODEL = "cara"


@dataclass(frozen=True)
class LiveSpec:
    workers: int = 2
    adapters: int = 32
    ranks: tuple[int, ...] = (8, 16, 32, 64)
    rate: float = 3.0  # aggregate requests per second
    duration_s: float = 20.0  # of trace, per policy
    prompt: tuple[int, int] = (16, 64)  # tokens, uniform inclusive
    output: tuple[int, int] = (24, 64)
    zipf_s: float = 1.0
    slo_factor: float = 1.5  # x the HF-PEFT level: one request alone, no adapter (§7.5)
    kernel: str = "padded"  # BGMV, as the paper's testbed (Fig. 20)
    max_batch: int = 16
    seed: int = 0
    policies: tuple[str, ...] = POLICIES

    def __post_init__(self) -> None:
        if self.workers < 1 or self.adapters < 1 or not self.ranks or min(self.ranks) < 1:
            raise ValueError(f"need workers >= 1, adapters >= 1 and ranks >= 1, got {self.workers}, "
                             f"{self.adapters}, {self.ranks}")
        if self.rate <= 0 or self.duration_s <= 0:
            raise ValueError(f"need rate > 0 and duration_s > 0, got {self.rate}, {self.duration_s}")
        for name, (lo, hi) in (("prompt", self.prompt), ("output", self.output)):
            if lo < 2 or hi < lo:
                raise ValueError(f"{name} lengths need 2 <= min <= max, got {lo}, {hi}")
        if "rank-aware" not in self.policies or set(self.policies) - set(POLICIES):
            raise ValueError(f"policies must include rank-aware and be among {', '.join(POLICIES)}, got {self.policies}")


def adapter_ranks(spec: LiveSpec) -> dict[str, int]:
    """Adapter name -> rank: the ranks in equal shares, shuffled (seeded)."""
    rng = np.random.default_rng(spec.seed + 1)
    width = len(str(spec.adapters - 1))
    ranks = rng.permutation([spec.ranks[i % len(spec.ranks)] for i in range(spec.adapters)])
    return {f"lora-{i:0{width}d}": int(r) for i, r in enumerate(ranks)}


def live_trace(spec: LiveSpec) -> Trace:
    """Poisson arrivals at `rate` for `duration_s`, each for an adapter drawn by Zipf popularity."""
    rng = np.random.default_rng(spec.seed)
    ranks = adapter_ranks(spec)
    names = list(ranks)
    gaps = rng.exponential(1.0 / spec.rate, int(spec.rate * spec.duration_s * 2) + 16)
    times = np.cumsum(gaps)
    times = times[times < spec.duration_s]
    n = len(times)
    popularity = rng.permutation(len(names))
    picked = popularity[rng.choice(len(names), n, p=zipf_probabilities(len(names), spec.zipf_s))]
    prompts = rng.integers(spec.prompt[0], spec.prompt[1] + 1, n)
    outputs = rng.integers(spec.output[0], spec.output[1] + 1, n)
    params = MAFParams(seed=spec.seed, duration_s=spec.duration_s, rate=spec.rate, adapters=spec.adapters,
                       zipf_s=spec.zipf_s, models=[MODEL], ranks=list(spec.ranks))
    infos = [AdapterInfo(name=a, model=MODEL, rank=r) for a, r in ranks.items()]
    return make_trace(params, spec.duration_s, times, [MODEL], np.zeros(n, np.int64), prompts, outputs,
                      names, picked, infos)


def sim_cost_profile(spec: LiveSpec, *, step_token_budget: int, max_model_len: int,
                     request_overhead_s: float) -> CostProfile:
    """Zeros for the base step (the measured LoRA model's beta and gamma are the whole step);
    the live workers' batch limits; every adapter resident (the Cached backend, as §7.5's testbed)."""
    return CostProfile(
        name="caraserve-live", description="the live cluster's limits; steps from `tidal profile lora` on this host",
        request_overhead_s=request_overhead_s,
        step=StepCost(overhead_s=0.0, decode_per_seq_s=0.0, decode_per_ctx_token_s=0.0, prefill_per_token_s=0.0,
                      prefill_attn_s=0.0),
        worker=WorkerSpec(kv_blocks=1 << 16, block_size=16, max_batch=spec.max_batch,
                          max_batched_tokens=step_token_budget, max_model_len=max_model_len,
                          max_resident_adapters=max(spec.adapters, 1), adapter_load_s=0.0))


class PolicyFigures(msgspec.Struct, kw_only=True):
    policy: str
    requests: int
    ok: int
    slo_attainment: float  # requests whose time per token met the SLO (a failed one never does)
    tpot_mean_s: float  # over requests that finished
    tpot_p50_s: float
    tpot_p99_s: float


def policy_figures(policy: str, records: list[RequestRecord], slo_s: float) -> PolicyFigures:
    t = tpots(records)
    finite = t[np.isfinite(t)]
    nan = float("nan")
    return PolicyFigures(
        policy=policy, requests=len(records), ok=sum(r.status == "ok" for r in records),
        slo_attainment=float(np.mean(t <= slo_s)) if len(t) else 0.0,
        tpot_mean_s=float(finite.mean()) if len(finite) else nan,
        tpot_p50_s=float(np.percentile(finite, 50)) if len(finite) else nan,
        tpot_p99_s=float(np.percentile(finite, 99)) if len(finite) else nan)


BASELINES = ("most-idle", "random", "first-fit")
LINE = re.compile(r"^repro caraserve \(live\): slo_attainment=(?P<slo>\d\.\d\d)"
                  r"(?P<vs>(?: tpot_vs_[a-z]+=[+-]\d+%)*) sim_vs_live_tpot=(?P<sim>[+-]\d+)%$")


@dataclass(frozen=True)
class LiveHeadline:
    slo_attainment: float  # rank-aware's, live
    tpot_vs: dict[str, float]  # baseline -> rank-aware's live mean TPOT / the baseline's - 1
    sim_vs_live: float  # rank-aware's simulated mean TPOT / its live one - 1

    def line(self) -> str:
        vs = "".join(f" tpot_vs_{b.replace('-', '')}={_pct(v)}" for b, v in self.tpot_vs.items())
        return f"repro caraserve (live): slo_attainment={self.slo_attainment:.2f}{vs} sim_vs_live_tpot={_pct(self.sim_vs_live)}"


def _pct(v: float) -> str:
    return f"{round(100 * v):+d}%"


def live_headline(live: dict[str, PolicyFigures], sim: dict[str, PolicyFigures]) -> LiveHeadline:
    ra = live["rank-aware"]
    vs = {b: ra.tpot_mean_s / live[b].tpot_mean_s - 1 for b in BASELINES if b in live}
    return LiveHeadline(slo_attainment=ra.slo_attainment, tpot_vs=vs,
                        sim_vs_live=sim["rank-aware"].tpot_mean_s / ra.tpot_mean_s - 1)


def parse_line(line: str) -> LiveHeadline:
    """The summary line back into figures (percent rounded as printed); ValueError if it is not one."""
    m = LINE.match(line.strip())
    if m is None:
        raise ValueError(f"not a `repro caraserve (live)` summary line: {line!r}")
    vs = {}
    for part in m["vs"].split():
        key, value = part.split("=")
        vs[key.removeprefix("tpot_vs_")] = int(value.rstrip("%")) / 100
    return LiveHeadline(slo_attainment=float(m["slo"]), tpot_vs=vs, sim_vs_live=int(m["sim"]) / 100)


__all__ = ["LINE", "LiveHeadline", "LiveSpec", "PolicyFigures", "adapter_ranks", "live_headline", "live_trace",
           "parse_line", "policy_figures", "sim_cost_profile"]
