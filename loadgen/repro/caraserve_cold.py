"""CaraServe's cold-start experiment (§7.2, Fig. 10/11/13/14) in the simulator, at paper scale.

One Llama-2-7B server on an A10, LightLLM-like (the paper's servers, §6): continuous batching where
newly arrived requests are prefilled in an iteration of their own, the running batch decoding in
the others (Fig. 2, Fig. 11). The ways to handle a request whose adapter is not on the GPU:

* cached, cached-mbgmv: every adapter resident (the oracle), on BGMV and on MBGMV;
* ondemand: the prefill iteration that admits it loads it first, over the one link; the whole
  iteration (and every request waiting behind it) waits (LightLLM's on-demand loading);
* slora: the same loading, with S-LoRA's own kernel (MBGMV, `segmented`); the others run BGMV
  (`padded`), as the paper equips them (§7.1). Its overhead is taken against `cached-mbgmv` (every
  adapter resident, the same MBGMV kernel), so the kernel's own cost is not booked as a cold start;
* async (ours, an extra arm): the load starts when the request arrives, beside the iterations
  (one link, FIFO); the request is not prefilled before it lands, nobody else waits;
* caraserve: the load and the CPU prefill start together when the request is admitted to a
  prefill iteration (Fig. 1; our live engine does the same): the LoRA part runs on CPU cores, the
  GPU takes over when the load lands (§4). A CPU-assisted iteration lasts
  max(GPU part, min(CPU LoRA part, time to the last landing + GPU part));
* caraserve-arrival (a labelled variant): the load starts at arrival as in async; it often lands
  while the request waits out an iteration, so CPU assist is rarely used.
`cpu_assisted` counts the prefills whose adapter was not on the GPU when they began (LoRA on CPU).

Kernel model beyond its data: Fig. 5 gives two batches per kernel (decode feature 768 and 1024:
16-24 requests); the two-point lines cross at 1088, past which MBGMV would be cheaper than BGMV at
uniform rank, against §5. The simulator clamps MBGMV's decode step to at least BGMV's for a
uniform batch of the same size and sum of ranks (`ClampedMbgmv`); inside 768-1024 it changes nothing.

Costs, every one from a source or a measurement:
* iterations: the LoRA performance model (profiles/lora/caraserve-a10-llama2-7b.toml: decode from
  Fig. 5, prefill from the A10 roofline), plus decoding's KV reads (a10-llama2-7b-lora.toml); a
  prefill iteration reads the weights too, so it lasts at least the decode model's beta;
* adapter bytes by rank: 32 layers x q/k/v x (A + B) x 4096 x rank x 2 B (96 MiB at rank 64),
  LoraGeometry; load = MovementCosts.load_s over the profile's PCIe link (A10 datasheet peak,
  32 GB/s) — and, as a variant, the paper's own effective rate: Fig. 3-Left's fit gives a rank-64
  load of 16.7 ms (tidal/bench/lora_stats.py), 6.0 GB/s;
* CPU LoRA: FLOP = 2 x 2 x 4096 x 3 x 32 = 1.573e6 per token and rank; `CPU_FLOPS_PER_CORE` measured
  (fp32 x·A·B at the paper's shape, one core), on `CPU_CORES` cores (Fig. 18-Right: 8), plus the
  invocation overhead of §4.2 (< 1 ms per iteration: 1 ms taken).

Deciding quantity: a prompt of L tokens costs L x r x 1.573e6 FLOP on CPU (T_cpu at n cores of f
FLOP/s) and its adapter r x 1.573e6 bytes on the link (X at B bytes/s); without assist it waits X,
then prefills in P. CPU assist wins when T_cpu < X + P (shared/policy/lora_cold_choice.py, the rule
the live engine applies per request): L·r·1.573e6 / (n·f) < r·1.573e6 / B + P.
"""
from __future__ import annotations

import math
import time
from collections import OrderedDict, deque
from dataclasses import dataclass, field

import numpy as np

from loadgen.repro.caraserve_kernel import FIT_RANGE, ClampedMbgmv  # noqa: F401
from loadgen.repro.caraserve_setting import ADAPTER_GEOMETRY, ALPACA_OUTPUT, ALPACA_PROMPT, LORA_PROFILE, MAF_CV
from loadgen.sim.profile import load_profile
from loadgen.traces.arrivals import arrivals, constant_rate
from loadgen.traces.lengths import QuantileLengths
from loadgen.traces.maf import zipf_probabilities
from shared.lora_profile_file import load_lora_profile
from shared.policy.lora_perf_model import LoraPerfModel

MODES = ("cached", "cached-mbgmv", "ondemand", "slora", "async", "caraserve", "caraserve-arrival")
ARMS = ("caraserve", "async", "ondemand", "slora", "caraserve-arrival")  # the cold arms, headline order
BASELINE_OF = {"slora": "cached-mbgmv"}  # every other arm against `cached` (BGMV)
KERNEL_OF = {"cached": "padded", "cached-mbgmv": "segmented", "ondemand": "padded", "slora": "segmented",
             "async": "padded", "caraserve": "padded", "caraserve-arrival": "padded"}
CPU_MODES = ("caraserve", "caraserve-arrival")
# one core of this workplace's shared AMD EPYC: fp32 x·A·B for 128 tokens, hidden 4096, rank 64 (one target of
# one layer), fastest of 15 — 4.65 ms = 28.9 GFLOP/s (bf16 measured 199 GFLOP/s, fp16 3.7 GFLOP/s: the
# paper does not say which its CPU LoRA uses; fp32 is PyTorch's CPU default)
CPU_FLOPS_PER_CORE = 28.9e9
CPU_CORES = 8  # CaraServe Fig. 18-Right: a 128-token prefill's LoRA on 8 CPUs
INVOKE_S = 1e-3  # CaraServe §4.2: shared memory brings the invocation overhead under 1 ms
PAPER_EFFECTIVE_BPS = 96 * 2**20 / 0.0167  # a rank-64 load of 16.7 ms (Fig. 3-Left fit): 6.03 GB/s
# A10: 24 GiB; weights 13.48 GB; the rest holds KV and adapters. OUR ASSUMPTION: half of it for adapters
# (S-LoRA's unified pool shares it; the paper does not say): an LRU of that many bytes per server.
ADAPTER_ROOM_BYTES = (24 * 2**30 - 13_476_831_232) // 2
MAX_BATCH = 64
PREFILL_BUDGET = 2048  # tokens per prefill iteration (the profile's max_batched_tokens)
PAPER = {  # §7.2 / Fig. 13: TTFT overhead vs Cached, on average
    "synthetic-r64": {"caraserve": 0.22, "ondemand": 4.12, "slora": 4.51},
    "synthetic-r32": {"caraserve": 0.36, "ondemand": 0.88, "slora": 1.26},
    "synthetic-r64-6rps": {"caraserve": 0.01, "ondemand": 0.42, "slora": 0.41},
    "maf-128": {"caraserve": 0.09, "ondemand": 0.31, "slora": 0.22},
}


@dataclass(frozen=True)
class ColdWorkload:
    name: str
    rate: float
    ranks: tuple[int, ...]
    adapters: int = 0  # 0: a distinct adapter per request (every request cold)
    cv: float = 1.0


COLD_WORKLOADS = {w.name: w for w in (
    ColdWorkload("synthetic-r64", 9.0, (64,)),
    ColdWorkload("synthetic-r32", 9.0, (32,)),
    ColdWorkload("synthetic-r64-6rps", 6.0, (64,)),
    *(ColdWorkload(f"synthetic-r64-{r:g}rps", r, (64,)) for r in (3.0, 4.5, 7.5)),  # the rate sweep
    ColdWorkload("maf-128", 1.5, (64,), adapters=128, cv=MAF_CV),
    ColdWorkload("maf-256", 3.6, (64,), adapters=256, cv=MAF_CV),
    ColdWorkload("maf-512", 7.7, (64,), adapters=512, cv=MAF_CV),
)}


@dataclass(frozen=True)
class ColdRequest:
    arrival: float
    prompt: int
    output: int
    adapter: int
    rank: int


@dataclass(frozen=True)
class ColdSetup:
    models: dict
    ctx_s: float  # KV read per context token of a decode iteration
    load_s: dict[int, float]  # rank -> load time
    adapter_bytes: dict[int, int]
    cpu_flops: float  # all helper cores
    invoke_s: float = INVOKE_S


def setup(load_bps: float | None = None, cpu_flops_per_core: float = CPU_FLOPS_PER_CORE,
          cpu_cores: int = CPU_CORES, ranks: tuple[int, ...] = (8, 16, 32, 64)) -> ColdSetup:
    """The A10 server: `load_bps` None = the profile's PCIe link (MovementCosts), else that rate."""
    profile = load_profile("a10-llama2-7b-lora")
    lora = load_lora_profile(LORA_PROFILE)
    costs = profile.movement_costs()
    sizes = {r: ADAPTER_GEOMETRY.adapter_bytes(r) for r in ranks}
    if load_bps is None:
        loads = {r: costs.load_s(b, in_host_memory=True) for r, b in sizes.items()}
    else:
        loads = {r: costs.host.latency_s + b / load_bps for r, b in sizes.items()}
    models = {"padded": lora.model("padded"), "segmented": ClampedMbgmv(lora.model("segmented"), lora.model("padded"))}
    return ColdSetup(models, profile.step.decode_per_ctx_token_s,
                     loads, sizes, cpu_flops_per_core * cpu_cores)


def cpu_lora_flop(tokens: int, rank: int) -> float:
    """FLOP of a prompt's LoRA (q/k/v, every layer of Llama-2-7B)."""
    g = ADAPTER_GEOMETRY
    return float(tokens * rank * 2 * 2 * g.hidden * g.targets * g.layers)


def build_requests(w: ColdWorkload, duration_s: float, seed: int) -> list[ColdRequest]:
    rng = np.random.default_rng(seed)
    times = arrivals(rng, constant_rate(w.rate), duration_s, cv=w.cv)
    n = len(times)
    prompts = QuantileLengths(ALPACA_PROMPT).sample(rng, n)
    outputs = QuantileLengths(ALPACA_OUTPUT).sample(rng, n)
    if w.adapters:
        order = rng.permutation(w.adapters)
        picked = order[rng.choice(w.adapters, n, p=zipf_probabilities(w.adapters, 1.0))]
        rank_of = rng.choice(np.asarray(w.ranks), w.adapters)
        ranks = rank_of[picked]
    else:
        picked = np.arange(n)
        ranks = rng.choice(np.asarray(w.ranks), n)
    return [ColdRequest(float(times[i]), max(1, int(prompts[i])), max(2, int(outputs[i])), int(picked[i]),
                        int(ranks[i])) for i in range(n)]


@dataclass
class _Live:
    req: ColdRequest
    ctx: int
    left: int


@dataclass
class ModeResult:
    mode: str
    ttft: np.ndarray
    tpot: np.ndarray
    e2e: np.ndarray
    prefill_iters: list[float] = field(default_factory=list)
    decode_iters: list[float] = field(default_factory=list)
    loads: int = 0
    prefills: int = 0
    cpu_assisted: int = 0  # prefills begun with the adapter off the GPU (LoRA on CPU)
    load_wait_s: float = 0.0  # iterations' time spent waiting for loads (ondemand/slora) or CPU (caraserve)
    wall_s: float = 0.0


def simulate(mode: str, reqs: list[ColdRequest], s: ColdSetup) -> ModeResult:
    """One server, iteration by iteration (§6's LightLLM: new requests' prefill first)."""
    if mode not in MODES:
        raise ValueError(f"unknown cold-start mode {mode!r}; choose from {', '.join(MODES)}")
    started = time.perf_counter()
    model = s.models[KERNEL_OF[mode]]
    weights_s = model.decode.beta_s  # a prefill iteration reads the weights as a decode one does
    resident: OrderedDict[int, None] = OrderedDict()
    room = max(1, ADAPTER_ROOM_BYTES)
    held = 0
    landed: dict[int, float] = {}  # adapter -> when its async load lands (async, caraserve)
    link_free = 0.0
    n = len(reqs)
    first = np.full(n, np.nan)
    done = np.full(n, np.nan)
    pending = deque(range(n))
    waiting: deque[int] = deque()
    running: list[tuple[int, _Live]] = []
    res = ModeResult(mode, np.empty(0), np.empty(0), np.empty(0))
    t = 0.0

    def make_resident(a: int, rank: int) -> bool:
        """True if the adapter was cold (LRU over ADAPTER_ROOM_BYTES)."""
        nonlocal held
        if mode.startswith("cached"):
            return False
        if a in resident:
            resident.move_to_end(a)
            return False
        size = s.adapter_bytes[rank]
        while resident and held + size > room:
            old, _ = resident.popitem(last=False)
            held -= s.adapter_bytes[reqs_rank[old]]
            landed.pop(old, None)
        resident[a] = None
        held += size
        res.loads += 1
        return True

    reqs_rank = {r.adapter: r.rank for r in reqs}
    while pending or waiting or running:
        while pending and reqs[pending[0]].arrival <= t:
            i = pending.popleft()
            waiting.append(i)
            r = reqs[i]
            if mode in ("async", "caraserve-arrival") and r.adapter not in landed and make_resident(r.adapter, r.rank):
                begin = max(r.arrival, link_free)
                link_free = landed[r.adapter] = begin + s.load_s[r.rank]
            elif mode in ("async", "caraserve-arrival") and r.adapter in resident:
                resident.move_to_end(r.adapter)
        eligible = [i for i in waiting if mode != "async" or landed.get(reqs[i].adapter, 0.0) <= t]
        batch, tokens = [], 0
        for i in eligible:
            if len(running) + len(batch) >= MAX_BATCH or (batch and tokens + reqs[i].prompt > PREFILL_BUDGET):
                break
            batch.append(i)
            tokens += reqs[i].prompt
        if batch:
            prompts = [(reqs[i].prompt, reqs[i].rank) for i in batch]
            gpu = max(weights_s, model.prefill_s(prompts))
            dt = gpu
            if mode in ("ondemand", "slora"):
                load = sum(s.load_s[reqs[i].rank] for i in batch if make_resident(reqs[i].adapter, reqs[i].rank))
                dt += load
                res.load_wait_s += load
            elif mode in CPU_MODES:
                if mode == "caraserve":  # the load starts now, with the CPU prefill (one link, FIFO)
                    for i in batch:
                        r = reqs[i]
                        if make_resident(r.adapter, r.rank):
                            link_free = landed[r.adapter] = max(t, link_free) + s.load_s[r.rank]
                cold = [i for i in batch if landed.get(reqs[i].adapter, 0.0) > t]
                res.cpu_assisted += len(cold)
                if cold:
                    cpu = sum(cpu_lora_flop(reqs[i].prompt, reqs[i].rank) for i in cold) / s.cpu_flops + s.invoke_s
                    land = max(landed[reqs[i].adapter] for i in cold) - t
                    dt = max(gpu, min(cpu, land + gpu))
                    res.load_wait_s += dt - gpu
            for i in batch:
                waiting.remove(i)
            res.prefills += len(batch)
            t += dt
            res.prefill_iters.append(dt)
            for i in batch:
                first[i] = t
                r = reqs[i]
                if r.output <= 1:
                    done[i] = t
                else:
                    running.append((i, _Live(r, r.prompt + 1, r.output - 1)))
            continue
        if running:
            # decode iterations until the next arrival (or landing) could change the batch
            ranks = [lv.req.rank for _, lv in running]
            step = model.decode_s(ranks)
            horizon = min([reqs[pending[0]].arrival] if pending else [math.inf])
            if waiting and mode == "async":
                horizon = min(horizon, min(landed.get(reqs[i].adapter, t) for i in waiting))
            until = math.ceil(max(0.0, horizon - t) / step) if math.isfinite(horizon) else 1 << 30
            k = max(1, min(min(lv.left for _, lv in running), until))
            ctx = sum(lv.ctx for _, lv in running)
            dt = k * (step + s.ctx_s * ctx) + s.ctx_s * len(running) * k * (k - 1) / 2
            t += dt
            res.decode_iters.extend([dt / k] * k)
            keep = []
            for i, lv in running:
                lv.left -= k
                lv.ctx += k
                if lv.left <= 0:
                    done[i] = t
                else:
                    keep.append((i, lv))
            running = keep
            continue
        nxt = [reqs[pending[0]].arrival] if pending else []
        if waiting and mode == "async":
            nxt.append(min(landed[reqs[i].adapter] for i in waiting))
        t = max(t, min(nxt))
    arrival = np.asarray([r.arrival for r in reqs])
    outs = np.asarray([r.output for r in reqs])
    res.ttft = first - arrival
    res.tpot = (done - first) / np.maximum(outs - 1, 1)
    res.e2e = done - arrival
    res.wall_s = time.perf_counter() - started
    return res


# saturated: Cached's p99 TTFT over its median (a queue builds). At 3-7.5 rps it is 1.6-1.9; at 9 rps 19-50
# (seeds 0-2, 120 s), where Cached's TPOT is also ~2x the 31.8 ms weights-read step.
SATURATED_TAIL = 4.0


@dataclass
class ColdRun:
    workload: str
    link: str  # "pcie-peak" | "paper-effective"
    load_s_rank64: float
    results: dict[str, ModeResult]
    seed: int = 0
    step_s: float = 0.0318  # the BGMV decode step's weights read (the model's beta)

    def overhead(self, mode: str, metric: str = "ttft") -> float:
        """Mean over requests vs its Cached's mean (S-LoRA: Cached on MBGMV), - 1 (the paper's "on average")."""
        base = float(np.mean(getattr(self.results[BASELINE_OF.get(mode, "cached")], metric)))
        return float(np.mean(getattr(self.results[mode], metric))) / base - 1

    def cpu_share(self, mode: str = "caraserve") -> float:
        res = self.results[mode]
        return res.cpu_assisted / max(1, res.prefills)

    @property
    def saturated(self) -> bool:
        ttft = self.results["cached"].ttft
        return float(np.percentile(ttft, 99)) > SATURATED_TAIL * float(np.median(ttft))


def run_cold(workloads: tuple[str, ...], duration_s: float, seeds: tuple[int, ...] | int = (0, 1, 2), *,
             links: tuple[str, ...] = ("pcie-peak",), cpu_flops_per_core: float = CPU_FLOPS_PER_CORE,
             cpu_cores: int = CPU_CORES, progress=None) -> list[ColdRun]:
    rates = {"pcie-peak": None, "paper-effective": PAPER_EFFECTIVE_BPS}
    runs = []
    for link in links:
        s = setup(rates[link], cpu_flops_per_core, cpu_cores)
        for name in workloads:
            for seed in ((seeds,) if isinstance(seeds, int) else seeds):
                reqs = build_requests(COLD_WORKLOADS[name], duration_s, seed)
                run = ColdRun(name, link, s.load_s[64], {m: simulate(m, reqs, s) for m in MODES}, seed,
                              s.models["padded"].decode.beta_s)
                runs.append(run)
                if progress:
                    progress(f"cold start {name:20s} {link:15s} seed {seed}: TTFT " + "  ".join(
                        f"{m} {100 * run.overhead(m):+.0f}%" for m in ARMS) + f"  cpu-assisted "
                        f"{100 * run.cpu_share():.0f}%{'  SATURATED' if run.saturated else ''}  ({len(reqs)} requests)")
    return runs


def pick(runs: list[ColdRun], workload: str, link: str) -> list[ColdRun]:
    """Every seed's run of one workload and link."""
    return [r for r in runs if r.workload == workload and r.link == link]


def seed_stats(chosen: list[ColdRun], value) -> tuple[float, float, float]:
    """(mean, min, max) over seeds of value(run)."""
    v = np.asarray([value(r) for r in chosen], dtype=float)
    return float(v.mean()), float(v.min()), float(v.max())


HEADLINE = ("synthetic-r64-6rps", "paper-effective")  # the paper's 6 rps row at its effective link: sustained


def cold_keys(runs: list[ColdRun], workload: str = HEADLINE[0], link: str = HEADLINE[1]) -> str:
    chosen = pick(runs, workload, link)
    keys = [f"cold_ttft_overhead_{m}={round(100 * seed_stats(chosen, lambda r, m=m: r.overhead(m))[0])}%"
            for m in ("caraserve", "async", "ondemand", "slora")]
    share = seed_stats(chosen, lambda r: r.cpu_share())[0]
    return " ".join(keys) + f" cpu_assisted_share={round(100 * share)}% seeds={len(chosen)}"


__all__ = ["ARMS", "COLD_WORKLOADS", "ColdRun", "HEADLINE", "MODES", "build_requests", "cold_keys", "cpu_lora_flop",
           "pick", "run_cold", "seed_stats", "setup", "simulate"]
