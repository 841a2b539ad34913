"""MELL §VIII-B's experimental setup: models, GPUs, testbeds and workloads.

Testbeds (Figs. 11-15): Llama-2-13B on an A100 40GB, Llama-2-7B on an RTX 4090 24GB. A
device's KV capacity is its memory minus the fp16 weights. Step times come from the cited
cost profiles in loadgen/sim/profiles/.

Workloads. §VIII-B: "The LLM request inputs are based on LMSYS-Chat-1M and WildChat ... we scale
up each conversation by a factor of ten. The LLM request arrival pattern of the workload is
generated from the following data. First, to simulate frequent, middle, and infrequent workloads,
we use three Poisson distributions with a setting of λ = 0.5, 0.8, and 1.1, respectively. Second,
we use the traces from multiple LLM inference services in Azure [6] collected on November 11th
2023". So:
- lengths: LMSYS-Chat-1M conversations x10 for every workload (the inputs); LMSYS-Chat-1M's published
  means are 69.5 prompt and 214.5 response tokens per turn (Zheng et al., ICLR 2024, Table 1); it
  publishes no quantiles, so the shape is BurstGPT's (KunServe Table 2, also ChatGPT conversation
  logs) rescaled to those means - our assumption (`--azure-lengths trace` replays the Azure trace's
  own token counts instead, for its two workloads);
- Poisson λ is the mean gap between arrivals, in seconds: the text pairs λ = 0.5 with *frequent*
  and 1.1 with *infrequent* arrivals, which a rate (requests per second) would reverse; the unit is
  not printed, seconds is ours (MELL's timings, Figs. 2-3 and §VIII's migrations per second, are in
  seconds). So 2.0, 1.25 and 0.91 requests per second;
- Azure: the real Azure LLM inference trace 2023 (Splitwise's, the paper's reference [6]; CC-BY 4.0,
  Patel et al., ISCA 2024), its conversation and its code service, replayed at their own arrival
  times and rates (5.5 and 2.6 requests per second over their hour) with the paper's inputs. It is
  read from ../shared/data/azure-llm-2023/ (the CSVs as published; `--azure-dir` for another copy).
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

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


AZURE_DIR = Path(__file__).resolve().parents[3] / "shared" / "data" / "azure-llm-2023"
AZURE_FILES = {"conv": "AzureLLMInferenceTrace_conv.csv", "code": "AzureLLMInferenceTrace_code.csv"}
AZURE_CREDIT = ("Azure LLM inference trace 2023 (github.com/Azure/AzurePublicDataset), CC-BY 4.0: P. Patel, "
                "E. Choukse, C. Zhang, A. Shah, I. Goiri, S. Maleki, R. Bianchini, \"Splitwise: Efficient "
                "generative LLM inference using phase splitting\", ISCA 2024")


@dataclass(frozen=True)
class Workload:
    key: str
    kind: str  # "poisson" or "azure"
    label: str
    mean_gap_s: float = 0.0  # Poisson: λ, the mean gap between arrivals
    service: str = ""  # Azure: "conv" or "code"

    @property
    def rate(self) -> float:
        """Mean requests per second (Poisson; an Azure trace's rate is its own)."""
        return 1.0 / self.mean_gap_s if self.mean_gap_s else 0.0


WORKLOADS: dict[str, Workload] = {
    "poisson-0.5": Workload("poisson-0.5", "poisson", "Poisson λ=0.5 s", mean_gap_s=0.5),
    "poisson-0.8": Workload("poisson-0.8", "poisson", "Poisson λ=0.8 s", mean_gap_s=0.8),
    "poisson-1.1": Workload("poisson-1.1", "poisson", "Poisson λ=1.1 s", mean_gap_s=1.1),
    "azure-conv": Workload("azure-conv", "azure", "Azure conv", service="conv"),
    "azure-code": Workload("azure-code", "azure", "Azure code", service="code"),
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


class AzureTraceMissing(FileNotFoundError):
    pass


def azure_trace(service: str, duration_s: float, azure_dir: str | Path | None = None):
    """The Azure 2023 trace of `service` ("conv" or "code"): its first `duration_s` seconds, as a Trace."""
    from loadgen.traces.loaders import load_azure_csv

    folder = Path(azure_dir) if azure_dir is not None else AZURE_DIR
    path = folder / AZURE_FILES[service]
    if not path.is_file():
        raise AzureTraceMissing(
            f"MELL's Azure workloads replay the Azure LLM inference trace 2023; {path} is missing. Put "
            f"{AZURE_FILES['conv']} and {AZURE_FILES['code']} (github.com/Azure/AzurePublicDataset, CC-BY 4.0) in "
            f"{folder}, pass --azure-dir DIR, or choose Poisson workloads only (--workloads poisson-0.5,...)")
    return load_azure_csv(path, duration_s=duration_s, model=f"azure-{service}")


def workload_requests(workload: Workload, duration_s: float, seed: int, *, azure_dir: str | Path | None = None,
                      azure_lengths: str = "paper") -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(arrival s, prompt tokens, output tokens) of a workload over [0, duration_s). Lengths: the paper's
    inputs (LMSYS-like x10), or for an Azure workload with `azure_lengths="trace"` the trace's own."""
    if azure_lengths not in ("paper", "trace"):
        raise ValueError(f"azure_lengths must be paper or trace, got {azure_lengths!r}")
    if workload.kind == "poisson":
        times = poisson_arrivals(np.random.default_rng(seed), constant_rate(workload.rate), duration_s)
        prompt, output = lmsys_lengths(np.random.default_rng(seed + 1), len(times))
        return times, prompt, output
    trace = azure_trace(workload.service, duration_s, azure_dir)
    times = np.array([r.arrival_s for r in trace.records], np.float64)
    if azure_lengths == "trace":
        return (times, np.array([r.prompt_tokens for r in trace.records], np.int64),
                np.array([r.output_tokens for r in trace.records], np.int64))
    prompt, output = lmsys_lengths(np.random.default_rng(seed + 1), len(times))
    return times, prompt, output
