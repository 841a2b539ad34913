"""The economy repro's default trace: three phases, each needing a different memory source.

1. `lora-heavy`: the two adapter models take most of the load, every request names an adapter, and the
   adapters' popularity is flat (MAF-like Zipf, s = 0.6, over 1,000 adapters per model): adapters come
   and go, so adapter memory is contested (CaraServe's source).
2. `kv-burst`: a burst on one model (the 13B) of chat requests at ~4x its share: its instances fill
   their KV (KunServe's drop, MELL's migration, a start; the under-loaded models' capacity).
3. `popularity-shift`: the most popular model falls to a trickle and another takes its load: the
   capacity the idle model holds is the remedy (a scale-down there, a prewarm evicted).

Arrivals and lengths are real: per (phase, model), consecutive rows of the Azure LLM inference trace
2023 (../shared/data/azure-llm-2023/: the conversation service for chat models, the coding service for
the coding model), from a seeded offset, time-compressed to the phase's rate (the CSV's own burstiness
kept), wrapping around the hour. Adapters: loadgen/traces/maf.py's Zipf popularity, ranks drawn from
8/16/32/64 (CaraServe §7.1).

Data: Azure LLM inference trace 2023, CC-BY 4.0. Pratyush Patel, Esha Choukse, Chaojie Zhang, Aashaka
Shah, Íñigo Goiri, Saeed Maleki, Ricardo Bianchini. "Splitwise: Efficient generative LLM inference
using phase splitting", ISCA 2024 (Azure/AzurePublicDataset).
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from loadgen.traces.build import make_trace
from loadgen.traces.loaders import load_azure_csv
from loadgen.traces.maf import zipf_probabilities
from loadgen.traces.schema import AdapterInfo, CsvImportParams, Trace

AZURE_DIR = Path(__file__).resolve().parents[3] / "shared" / "data" / "azure-llm-2023"
RANKS = (8, 16, 32, 64)


@dataclass(frozen=True)
class Phase:
    name: str
    shares: tuple[float, ...]  # of the rate, per model in the profile's order
    load: float = 1.0  # the phase's rate: the trace's rate x load
    adapter_fraction: float = 0.5  # share of an adapter model's requests that name an adapter
    zipf_s: float = 1.0  # adapter popularity within a model
    kinds: tuple[str, ...] = ("conv", "conv", "code", "conv")  # Azure service per model
    # per model: keep only the service's rows whose output is at or above this quantile of its outputs (0: all
    # rows): a burst of long generations, real rows of the trace
    output_q: tuple[float, ...] = (0.0, 0.0, 0.0, 0.0)


# models: llama2-7b-0, llama2-7b-1 (adapter models), llama2-13b, llama2-70b (the economy-h800 fleet's order)
PHASES: tuple[Phase, ...] = (
    Phase("lora-heavy", (0.45, 0.35, 0.12, 0.08), 1.0, adapter_fraction=1.0, zipf_s=0.6),
    Phase("kv-burst", (0.15, 0.12, 0.63, 0.10), 1.3, kinds=("conv", "conv", "conv", "conv"),
          output_q=(0.0, 0.0, 0.75, 0.0)),
    Phase("popularity-shift", (0.03, 0.60, 0.15, 0.22), 1.0),
)


@functools.lru_cache(maxsize=4)
def azure_rows(kind: str, root: str = str(AZURE_DIR)) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(seconds from the first row, prompt tokens, output tokens) of the Azure 2023 `kind` service."""
    path = Path(root) / f"AzureLLMInferenceTrace_{kind}.csv"
    if not path.exists():
        raise FileNotFoundError(f"the phased economy trace needs {path} (the Azure LLM inference trace 2023, "
                                "../shared/data/azure-llm-2023/)")
    tr = load_azure_csv(path)
    return (np.array([r.arrival_s for r in tr.records]), np.array([r.prompt_tokens for r in tr.records]),
            np.array([r.output_tokens for r in tr.records]))


def _slice(rng: np.random.Generator, kind: str, rate: float, duration_s: float, output_q: float = 0.0):
    """Consecutive rows from a seeded offset, compressed to `rate` on average, for `duration_s` (only the rows
    whose output is at or above the `output_q` quantile, their own arrival times kept)."""
    t, p, o = azure_rows(kind)
    if output_q > 0:
        sel = o >= np.quantile(o, output_q)
        t, p, o = t[sel], p[sel], o[sel]
    span = float(t[-1]) + float(np.diff(t).mean())  # one hour, and the gap back to its start
    factor = (len(t) / span) / rate  # trace seconds per CSV second
    start = int(rng.integers(len(t)))
    laps = int(duration_s / factor / span) + 2
    pos = start + np.arange(len(t) * laps)
    idx = pos % len(t)
    at = (t[idx] + (pos // len(t)) * span - t[start]) * factor
    keep = at < duration_s
    return at[keep], p[idx][keep], o[idx][keep]


def phased_trace(models: list[str], adapter_models: list[str], rate: float, seed: int, phase_s: float,
                 phases: tuple[Phase, ...] = PHASES, adapters_per_model: int = 1000, max_model_len: int = 4096) -> Trace:
    """The phases back to back, `phase_s` each, at `rate` req/s (x each phase's load)."""
    if rate <= 0 or phase_s <= 0 or not phases:
        raise ValueError(f"phased trace: rate and phase_s must be > 0 and phases non-empty (got {rate}, {phase_s})")
    for ph in phases:
        if len(ph.shares) != len(models) or len(ph.kinds) != len(models):
            raise ValueError(f"phase {ph.name}: {len(ph.shares)} shares / {len(ph.kinds)} kinds for {len(models)} "
                             "models")
    unknown = [m for m in adapter_models if m not in models]
    if unknown:
        raise ValueError(f"phased trace: adapter model(s) {unknown} are not among the models")
    rng = np.random.default_rng(seed)
    names: list[str | None] = []
    infos: list[AdapterInfo] = []
    first: dict[str, int] = {}
    for m in adapter_models:
        first[m] = len(names)
        names += [f"{m}-lora-{j:04d}" for j in range(adapters_per_model)]
        infos += [AdapterInfo(name=f"{m}-lora-{j:04d}", model=m, rank=int(r))
                  for j, r in enumerate(rng.choice(np.asarray(RANKS), adapters_per_model))]
    by_rank = {m: first[m] + rng.permutation(adapters_per_model) for m in adapter_models}
    names.append(None)
    cols: list[tuple[np.ndarray, ...]] = []
    for k, ph in enumerate(phases):
        for i, m in enumerate(models):
            r = rate * ph.load * ph.shares[i]
            if r <= 0:
                continue
            t, p, o = _slice(rng, ph.kinds[i], r, phase_s, ph.output_q[i])
            a = np.full(len(t), len(names) - 1, np.int64)
            if m in by_rank:
                use = np.flatnonzero(rng.random(len(t)) < ph.adapter_fraction)
                picks = rng.choice(adapters_per_model, len(use), p=zipf_probabilities(adapters_per_model, ph.zipf_s))
                a[use] = by_rank[m][picks]
            cols.append((t + k * phase_s, np.full(len(t), i, np.int64), p, o, a))
    times, model_idx, prompts, outputs, adapter_idx = (np.concatenate(c) for c in zip(*cols))
    prompts = np.minimum(prompts, max_model_len - 1)
    outputs = np.maximum(1, np.minimum(outputs, max_model_len - prompts))
    duration = phase_s * len(phases)
    params = CsvImportParams(source=f"azure-llm-2023 conv+code, phased ({', '.join(p.name for p in phases)}; "
                                    f"{phase_s:g} s each, {rate:g} req/s, seed {seed})",
                             format="azure", rows_read=len(times), rows_kept=len(times), duration_s=duration)
    return make_trace(params, duration, times, models, model_idx, prompts, outputs, names, adapter_idx, infos)


def phase_of(arrival_s: np.ndarray, phase_s: float, n: int) -> np.ndarray:
    """Per request, the index of the phase it arrived in."""
    return np.minimum(n - 1, (np.asarray(arrival_s) // phase_s).astype(np.int64))


__all__ = ["AZURE_DIR", "PHASES", "Phase", "azure_rows", "phase_of", "phased_trace"]
