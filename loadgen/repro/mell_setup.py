"""MELL §VIII-B's experimental setup: models, GPUs, testbeds and workloads.

Testbeds (Figs. 11-15): Llama-2-13B on an A100 40GB, Llama-2-7B on an RTX 4090 24GB. A
device's KV capacity is its memory minus the fp16 weights. Step times come from the cited
cost profiles in loadgen/sim/profiles/.

Workloads: request lengths follow LMSYS-Chat-1M conversations scaled up ten-fold (§VIII-B,
"to simulate ... long-context"); arrivals are Poisson at 0.5, 0.8, 1.1 requests/s, or the
Azure-like diurnal pattern of loadgen/traces/azure.py (§VIII-B uses Azure's production
arrival pattern, Splitwise's traces, with the same LMSYS/WildChat inputs).

LMSYS-Chat-1M's published means are 69.5 prompt and 214.5 response tokens per turn (Zheng et
al., ICLR 2024, Table 1); it publishes no quantiles, so the shape is BurstGPT's (KunServe
Table 2, also ChatGPT conversation logs) rescaled to those means - our assumption.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from loadgen.sim.profile import CostProfile, load_profile
from loadgen.traces.arrivals import arrivals as poisson_arrivals
from loadgen.traces.arrivals import constant_rate
from loadgen.traces.lengths import DATASETS, LengthQuantiles, QuantileLengths

GIB = 1 << 30
LMSYS_MEAN_PROMPT, LMSYS_MEAN_OUTPUT = 69.5, 214.5
LENGTH_SCALE = 10  # §VIII-B: "we scale up each conversation by a factor of ten"


@dataclass(frozen=True)
class ModelConfig:
    """The fields of a Hugging Face config.json that size the KV cache."""

    name: str
    layers: int
    kv_heads: int
    head_dim: int
    params: int
    dtype_bytes: int = 2  # fp16

    def kv_bytes_per_token(self) -> int:
        return self.layers * self.kv_heads * self.head_dim * 2 * self.dtype_bytes  # K and V

    def weights_bytes(self) -> int:
        return self.params * self.dtype_bytes


LLAMA2_7B = ModelConfig("Llama-2-7B", layers=32, kv_heads=32, head_dim=4096 // 32, params=6_738_415_616)
LLAMA2_13B = ModelConfig("Llama-2-13B", layers=40, kv_heads=40, head_dim=5120 // 40, params=13_015_864_320)


@dataclass(frozen=True)
class Testbed:
    key: str
    model: ModelConfig
    gpu: str
    gpu_memory_bytes: int
    profile_name: str
    paper_label: str  # the sub-figure it reproduces

    def capacity(self) -> int:
        """KV bytes per device: GPU memory minus weights."""
        return self.gpu_memory_bytes - self.model.weights_bytes()

    def profile(self) -> CostProfile:
        profile = load_profile(self.profile_name)
        w = profile.worker
        if w.kv_bytes_per_token != self.model.kv_bytes_per_token() or w.weights_bytes != self.model.weights_bytes():
            raise ValueError(f"profile {self.profile_name}: KV bytes per token / weights disagree with {self.model.name}")
        return profile

    def decode_step_s(self, occupancy: float) -> float:
        """One decode step with the device's KV `occupancy` full (weights + KV read once)."""
        step = self.profile().step
        return step.overhead_s + step.decode_per_ctx_token_s * occupancy * self.capacity() / self.model.kv_bytes_per_token()

    def prefill_s_per_token(self) -> float:
        return self.profile().step.prefill_per_token_s


TESTBEDS: dict[str, Testbed] = {
    "13b-a100": Testbed("13b-a100", LLAMA2_13B, "A100 40GB", 40 * GIB, "a100-40g-llama2-13b",
                        "(a) LLaMA-13B on NVIDIA A100"),
    "7b-4090": Testbed("7b-4090", LLAMA2_7B, "RTX 4090 24GB", 24 * GIB, "rtx4090-llama2-7b",
                       "(b) LLaMA-7B on NVIDIA 4090"),
}


@dataclass(frozen=True)
class Workload:
    key: str
    kind: str  # "poisson" or "azure"
    rate: float  # mean requests per second
    label: str


WORKLOADS: dict[str, Workload] = {
    "poisson-0.5": Workload("poisson-0.5", "poisson", 0.5, "Poisson λ=0.5"),
    "poisson-0.8": Workload("poisson-0.8", "poisson", 0.8, "Poisson λ=0.8"),
    "poisson-1.1": Workload("poisson-1.1", "poisson", 1.1, "Poisson λ=1.1"),
    "azure": Workload("azure", "azure", 0.8, "Azure"),
}


def _rescaled(q: LengthQuantiles, mean: float) -> LengthQuantiles:
    k = mean / q.mean
    return LengthQuantiles(mean, q.p50 * k, q.p80 * k, q.p95 * k, q.p99 * k)


def lmsys_lengths(rng: np.random.Generator, n: int, scale: int = LENGTH_SCALE) -> tuple[np.ndarray, np.ndarray]:
    """(prompt, output) tokens: LMSYS-Chat-1M means with BurstGPT's shape, times `scale`."""
    shape = DATASETS["burstgpt"]
    prompt = QuantileLengths(_rescaled(shape.prompt, LMSYS_MEAN_PROMPT)).sample(rng, n)
    output = QuantileLengths(_rescaled(shape.output, LMSYS_MEAN_OUTPUT)).sample(rng, n)
    return prompt * scale, output * scale


def arrivals(workload: Workload, duration_s: float, seed: int) -> np.ndarray:
    """Arrival times in [0, duration_s). Azure: a whole day of the diurnal generator (two
    services, conversation and code, as in Splitwise's Azure traces) compressed into
    `duration_s`, so the daily swing of load plays out within the run."""
    rng = np.random.default_rng(seed)
    if workload.kind == "poisson":
        return poisson_arrivals(rng, constant_rate(workload.rate), duration_s)
    from loadgen.traces.azure import DAY_S, generate_azure
    from loadgen.traces.schema import AzureParams

    squeeze = DAY_S / duration_s
    trace = generate_azure(AzureParams(seed=seed, duration_s=DAY_S, rate=workload.rate / squeeze,
                                       models=["conv", "code"], kinds=["conv", "code"]))
    return np.array([r.arrival_s / squeeze for r in trace.records])
