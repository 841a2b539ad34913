"""WarmServe §7.1's setting for `tidal repro warmserve`: workloads, systems, each model's window of the trace.

Traces. The real Azure LLM inference traces of 2023 (Azure/AzurePublicDataset, CC-BY 4.0:
Patel et al., "Splitwise: Efficient generative LLM inference using phase splitting", ISCA 2024),
read unchanged from `../shared/data/azure-llm-2023/`: about an hour each of the conversation service
(19,366 requests) and the coding service (8,819). The paper samples each model's requests from one hour
of a different day of the week-long 2024 release (Table 1: Thursday to Sunday) and replays the first 20
minutes; that release is not here, so every model gets its own window of the one real hour (issue 30):
model k replays [start_k, start_k + duration) with start_k spread evenly from `history_s` (model 0) to
the trace's last arrival minus the duration (the last model), so the windows are different stretches of
the real service (they overlap: four 20-minute windows in one hour), and each model's forecast history
is the real trace before its window, never its future. As the public code does: model i gets
int(RPS x duration x share_i) requests, shares by the power law i^-alpha (alpha 2 gives Llama2-7B-0
70.2%, §7.3); each row of the window is repeated ceil(n / rows) times and n of them are drawn without
replacement (seeded), keeping each drawn row's arrival time (from the window's start) and lengths;
inputs are capped at 1,024 tokens, outputs at least 3 and at most 1,023 tokens. The history before a
window is drawn the same way at the same rate. Forecasts: loadgen/repro/warmserve_forecast.py.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import numpy as np

from loadgen.sim.fleet_profile import FleetProfile
from loadgen.sim.fleet_state import FleetSystem
from loadgen.traces.azure import power_law_shares
from loadgen.traces.build import make_trace
from loadgen.traces.loaders import load_azure_csv
from loadgen.traces.schema import CsvImportParams, Trace

AZURE_DIR = Path(__file__).resolve().parents[3] / "shared" / "data" / "azure-llm-2023"
AZURE_FILES = {"conv": "AzureLLMInferenceTrace_conv.csv", "code": "AzureLLMInferenceTrace_code.csv"}
ATTRIBUTION = ("Azure LLM inference traces 2023 (Azure/AzurePublicDataset), CC-BY 4.0: Patel et al., "
               "\"Splitwise: Efficient generative LLM inference using phase splitting\", ISCA 2024")
INPUT_CAP = 1024  # trace_generator.py: inputlen = min(1024, ContextTokens)
OUTPUT_MIN, OUTPUT_CAP = 3, 1023  # outputlen = max(3, GeneratedTokens); request_generator.py: min(output, 1023)


@dataclass(frozen=True)
class Workload:
    key: str
    kind: str  # conv | code: which Azure service's hour
    alpha: float
    figure: str  # the paper's figures for this setting

    @property
    def title(self) -> str:
        return f"{'AzureConv' if self.kind == 'conv' else 'AzureCode'}, alpha={self.alpha}"


WORKLOADS: dict[str, Workload] = {
    "conv-a0.5": Workload("conv-a0.5", "conv", 0.5, "Fig. 9 (alpha=0.5), 11, 13"),
    "conv-a2.0": Workload("conv-a2.0", "conv", 2.0, "Fig. 9 (alpha=2.0), 11, 17"),
    "code-a0.5": Workload("code-a0.5", "code", 0.5, "Figs. 14, 15"),
}

# MuxServe's placements as §7.3 describes them (Fig. 10): for alpha=0.5 it co-locates 7B-0 and
# 70B on 8 GPUs; for alpha=2.0, 7B-0, 7B-1 and 13B share 8 GPUs. The rest runs alone.
MUXSERVE_MESHES: dict[float, list[tuple[tuple[int, ...], tuple[str, ...]]]] = {
    0.5: [(tuple(range(8)), ("llama2-7b-0", "llama2-70b")), (tuple(range(8, 12)), ("llama2-7b-1",)),
          (tuple(range(12, 16)), ("llama2-13b",))],
    2.0: [(tuple(range(8)), ("llama2-7b-0", "llama2-7b-1", "llama2-13b")), (tuple(range(8, 16)), ("llama2-70b",))],
}


def systems() -> dict[str, FleetSystem]:
    """The autoscaling systems of §7.3, all with the public code's autoscaler, the same start costs and
    stopped instances' weights kept on their GPUs (WarmServe: in their prewarm slot; SLLM-GPU: its GPU
    cache). They differ only in prewarming and in whether engines come from a pool."""
    return {
        "WarmServe": FleetSystem("WarmServe", prewarm="proactive"),
        "WarmServe-noproactive": FleetSystem("WarmServe-noproactive", prewarm="reactive"),
        "SLLM-GPU": FleetSystem("SLLM-GPU", prewarm="none", engine_pool=False),
        "SLLM-GPU+pool": FleetSystem("SLLM-GPU+pool", prewarm="none", engine_pool=True),
    }


Requests = tuple[np.ndarray, np.ndarray, np.ndarray]  # arrival times, prompt and output tokens


@dataclass(frozen=True)
class SourceHour:
    path: str
    times: np.ndarray  # seconds from the first request
    prompts: np.ndarray
    outputs: np.ndarray
    span_s: float  # the hour the rows are drawn from (3600)


@lru_cache(maxsize=4)
def load_hour(kind: str, azure_dir: str = str(AZURE_DIR), span_s: float = 3600.0) -> SourceHour:
    path = Path(azure_dir) / AZURE_FILES[kind]
    if not path.is_file():
        raise FileNotFoundError(f"{path}: the Azure LLM 2023 {kind} trace is not there (--azure-dir names the "
                                f"directory holding {', '.join(AZURE_FILES.values())})")
    trace = load_azure_csv(path)
    times = np.array([r.arrival_s for r in trace.records])
    keep = times < span_s
    return SourceHour(str(path), times[keep], np.array([r.prompt_tokens for r in trace.records])[keep],
                      np.array([r.output_tokens for r in trace.records])[keep], span_s)


def model_starts(hour: SourceHour, models: int, duration_s: float, history_s: float) -> list[float]:
    """Where each model's window begins in the real trace: evenly from history_s to the last arrival - duration."""
    last = float(hour.times.max()) if len(hour.times) else 0.0
    room = last - duration_s - history_s
    if duration_s <= 0 or history_s < 0 or room < 0:
        raise ValueError(f"{hour.path}: the trace spans {last:.0f} s; {history_s:g} s of history before a "
                         f"{duration_s:g} s replay do not fit (need duration > 0 and history >= 0)")
    return [history_s + (room * k / (models - 1) if models > 1 else 0.0) for k in range(models)]


def sample_span(hour: SourceHour, lo: float, hi: float, n: int, rng: np.random.Generator) -> Requests:
    """n requests from the rows arriving in [lo, hi), drawn as the public code draws them (every row
    ceil(n / rows) times, n of those without replacement), arrival times from lo, sorted."""
    span = np.flatnonzero((hour.times >= lo) & (hour.times < hi))
    if n <= 0 or len(span) == 0:
        return np.zeros(0), np.zeros(0, np.int64), np.zeros(0, np.int64)
    copies = (n - 1) // len(span) + 1
    idx = span[rng.choice(len(span) * copies, size=n, replace=False) % len(span)]
    times = hour.times[idx] - lo
    prompts = np.minimum(hour.prompts[idx], INPUT_CAP)
    outputs = np.clip(hour.outputs[idx], OUTPUT_MIN, OUTPUT_CAP)
    order = np.argsort(times, kind="stable")
    return times[order], prompts[order], outputs[order]


def model_requests(profile: FleetProfile, w: Workload, rps: float, seed: int, duration_s: float, history_s: float,
                   azure_dir: str = str(AZURE_DIR), window_s: float = 0.0) -> list[Requests]:
    """Per model, its replay window's requests (window_s 0), or (window_s > 0) the history before its window:
    the whole windows of window_s that fit between the trace's start and the replay's, times from the first."""
    hour = load_hour(w.kind, azure_dir)
    shares = power_law_shares(len(profile.models), w.alpha)
    out = []
    for k, (share, start) in enumerate(zip(shares, model_starts(hour, len(shares), duration_s, history_s))):
        rng = np.random.default_rng([seed, 1 if window_s else 0, k, int(round(rps * 1000))])
        lo, hi = (start - (start // window_s) * window_s, start) if window_s else (start, start + duration_s)
        out.append(sample_span(hour, lo, hi, int(rps * (hi - lo) * float(share)), rng))
    return out


def build_trace(profile: FleetProfile, w: Workload, rps: float, seed: int, azure_dir: str = str(AZURE_DIR),
                duration_s: float = 1200.0, history_s: float = 900.0) -> Trace:
    """The replay: every model's own window of the real trace, each from t = 0."""
    names = [m.name for m in profile.models]
    parts = model_requests(profile, w, rps, seed, duration_s, history_s, azure_dir)
    hour = load_hour(w.kind, azure_dir)
    idx = np.concatenate([np.full(len(t), k, np.int64) for k, (t, _, _) in enumerate(parts)])
    params = CsvImportParams(source=hour.path, format="azure", rows_read=len(hour.times), rows_kept=int(len(idx)),
                             duration_s=duration_s)
    return make_trace(params, duration_s, np.concatenate([p[0] for p in parts]), names, idx,
                      np.concatenate([p[1] for p in parts]), np.concatenate([p[2] for p in parts]))


def window_loads(times: np.ndarray, elapse: np.ndarray, span_s: float, window_s: float) -> tuple[list[float], list[float]]:
    """(avg, peak) concurrent requests per window: each request is in the system for its `elapse`
    from its arrival (the public code's get_character_from_csv)."""
    n = int(round(span_s / window_s))
    if len(times) == 0:
        return [0.0] * n, [0.0] * n
    ev_t = np.concatenate([times, times + elapse])
    ev_d = np.concatenate([np.ones(len(times)), -np.ones(len(times))])
    order = np.lexsort((ev_d, ev_t))  # at one instant, ends before starts
    ev_t, count = ev_t[order], np.cumsum(ev_d[order])
    integral = np.concatenate([[0.0], np.cumsum(count[:-1] * np.diff(ev_t))])  # of the count, at each event
    edges = np.arange(n + 1) * window_s
    at_edges = np.interp(edges, ev_t, integral, left=0.0, right=float(integral[-1]))
    avg = np.diff(at_edges) / window_s
    peak = np.zeros(n)
    inside = ev_t < n * window_s
    np.maximum.at(peak, (ev_t[inside] // window_s).astype(np.int64), count[inside])
    entering = np.searchsorted(ev_t, edges[:-1], side="right") - 1  # the count carried into each window
    carried = np.where(entering >= 0, count[np.maximum(entering, 0)], 0.0)
    return avg.tolist(), np.maximum(np.maximum(peak, carried), avg).tolist()
