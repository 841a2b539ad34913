"""The trace file format: JSONL, one header line then one `TraceRecord` per line.

Line 1 is a `TraceHeader` (it has the key `tidal_trace`, the format version) with the
generator's parameters, so a trace file says how it was made. Every further line is a
`TraceRecord`, in arrival order. Times are seconds from the start of the trace.
"""
from __future__ import annotations

from typing import Literal

import msgspec

TRACE_FORMAT_VERSION = 1
LengthDataset = Literal["burstgpt", "azureconv", "agieval-cot", "azurecode"]


class Segment(msgspec.Struct, frozen=True, array_like=True):
    """A named run of prompt tokens: equal keys in one trace are equal token ids (a shared prefix)."""

    key: str
    tokens: int


class TraceRecord(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    """One request: when it arrives, what it asks for, how long it is."""

    arrival_s: float  # seconds from the start of the trace
    model: str
    prompt_tokens: int
    output_tokens: int  # tokens the request generates (sent as max_tokens, ignore_eos)
    adapter: str | None = None  # LoRA adapter name, None for the base model
    request_id: str | None = None
    session: str | None = None  # conversation id, where the source has one
    # the prompt as named segments, in order (their tokens sum to prompt_tokens): requests whose segments
    # start alike share that prefix token for token (loadgen/traces/prefix.py); empty: no shared prefix
    segments: tuple[Segment, ...] = ()


class AdapterInfo(msgspec.Struct, frozen=True, kw_only=True):
    """An adapter a trace uses: its base model and LoRA rank."""

    name: str
    model: str
    rank: int


# --- generator parameters (the header's `params`, tagged by `generator`) --------------
class Burst(msgspec.Struct, frozen=True, kw_only=True):
    start_s: float
    duration_s: float
    magnitude: float  # the rate during the burst is `magnitude` x the base rate
    ramp_s: float = 2.0  # linear rise (and fall) time: bursts arrive "within seconds"


class BurstGPTParams(msgspec.Struct, frozen=True, kw_only=True, tag_field="generator", tag="burstgpt"):
    seed: int = 0
    duration_s: float = 600.0
    rate: float = 2.0  # base requests per second
    bursts: list[Burst] = []
    cv: float = 1.0  # coefficient of variation of inter-arrival gaps (1 = Poisson, >1 burstier, gamma)
    dataset: LengthDataset = "burstgpt"
    model: str = "model-0"


class AzureParams(msgspec.Struct, frozen=True, kw_only=True, tag_field="generator", tag="azure"):
    seed: int = 0
    duration_s: float = 86_400.0
    rate: float = 1.0  # mean requests per second over all models (over a whole week)
    models: list[str] = msgspec.field(default_factory=lambda: ["model-0", "model-1", "model-2", "model-3"])
    alpha: float = 0.5  # model i (1-based) gets a share proportional to i ** -alpha
    kinds: list[Literal["conv", "code"]] = msgspec.field(default_factory=lambda: ["conv"])  # workload per model, cycled over the models
    daily_amplitude: float = 0.6  # rate(t) ~ 1 + A cos(2 pi (t - peak) / day)
    peak_hour: float = 14.0  # hour of the daily peak (trace starts at 00:00 on a Monday)
    weekend_factor: float = 0.6  # Saturday and Sunday rates relative to weekdays
    phase_jitter_h: float = 1.5  # per-model shift of the daily peak, uniform in +-this
    cv: float = 1.0  # short-term burstiness of inter-arrival gaps (gamma), 1 = Poisson


class MAFParams(msgspec.Struct, frozen=True, kw_only=True, tag_field="generator", tag="maf"):
    seed: int = 0
    duration_s: float = 300.0
    rate: float = 6.0  # aggregate requests per second (Poisson)
    adapters: int = 2000
    zipf_s: float = 1.0  # invocation probability of the adapter at popularity rank k ~ k ** -zipf_s
    models: list[str] = msgspec.field(default_factory=lambda: ["model-0"])  # adapters are spread over the base models at random
    ranks: list[int] = msgspec.field(default_factory=lambda: [8, 16, 32, 64])  # adapter ranks, drawn uniformly
    base_fraction: float = 0.0  # share of requests that use no adapter
    dataset: LengthDataset = "burstgpt"


class PoissonParams(msgspec.Struct, frozen=True, kw_only=True, tag_field="generator", tag="poisson"):
    seed: int = 0
    duration_s: float = 60.0
    rate: float = 1.0
    model: str = "model-0"
    dataset: LengthDataset = "burstgpt"
    prompt_tokens: int | None = None  # fixed lengths instead of the dataset's distribution
    output_tokens: int | None = None


class ModelBurst(msgspec.Struct, frozen=True, kw_only=True):
    """A burst of one model's load: its rate is `magnitude` x its diurnal rate while it lasts."""

    model: str
    start_s: float
    duration_s: float
    magnitude: float
    ramp_s: float = 2.0  # linear rise (and fall) time


class MixedParams(msgspec.Struct, frozen=True, kw_only=True, tag_field="generator", tag="mixed"):
    """Many models with power-law popularity, Zipf adapters on some, diurnal drift, bursts, short and long requests."""

    seed: int = 0
    duration_s: float = 3600.0
    rate: float = 10.0  # mean requests per second over all models (bursts come on top)
    models: list[str] = msgspec.field(default_factory=lambda: [f"model-{i}" for i in range(8)])
    alpha: float = 1.0  # model i (1-based, in the list's order) gets a share proportional to i ** -alpha
    period_s: float = 86_400.0  # the diurnal period (shorten it to see days in a short trace)
    daily_amplitude: float = 0.5  # rate_i(t) ~ 1 + A cos(2 pi (t / period - phase_i))
    phase_spread: float = 0.25  # per-model phase, uniform in +-this fraction of a period: popularity drifts
    cv: float = 1.5  # coefficient of variation of inter-arrival gaps (gamma; 1 = Poisson)
    bursts: list[ModelBurst] = []
    adapter_models: list[str] = []  # the models that carry adapters
    adapters_per_model: int = 100
    zipf_s: float = 1.0  # within a model, the adapter at popularity rank k is invoked ~ k ** -zipf_s
    adapter_fraction: float = 0.8  # share of an adapter model's requests that name an adapter
    ranks: list[int] = msgspec.field(default_factory=lambda: [8, 16, 32, 64])  # adapter ranks, drawn uniformly
    dataset: LengthDataset = "azureconv"  # lengths of the short requests
    long_fraction: float = 0.1  # share of long requests: a draw of `dataset` scaled by the factors below
    long_prompt_factor: float = 8.0
    long_output_factor: float = 4.0


class CsvImportParams(msgspec.Struct, frozen=True, kw_only=True, tag_field="generator", tag="csv"):
    source: str  # path of the CSV as given
    format: Literal["burstgpt", "azure"]
    rows_read: int
    rows_kept: int
    start_s: float = 0.0  # window of the source that was kept (seconds from its first row)
    duration_s: float | None = None


class PrefixChatParams(msgspec.Struct, frozen=True, kw_only=True, tag_field="generator", tag="prefix-chat"):
    """Multi-turn chat: each turn's prompt is the conversation so far plus a new user message."""

    seed: int = 0
    duration_s: float = 60.0
    rate: float = 0.2  # new conversations per second (Poisson)
    model: str = "model-0"
    turns: tuple[int, int] = (3, 6)  # turns per conversation, uniform in [lo, hi]
    system_tokens: int = 64  # each conversation's own system prompt
    user_tokens: tuple[int, int] = (48, 128)  # a user message, uniform in [lo, hi]
    output_tokens: int = 32  # each reply; the next turn's history holds a stand-in of this length
    think_s: float = 4.0  # mean gap between a turn's arrival and the next (exponential, at least 1 s)


class PrefixSystemParams(msgspec.Struct, frozen=True, kw_only=True, tag_field="generator", tag="prefix-system"):
    """Shared system prompts: N distinct long system prompts, each request one of them + its own question."""

    seed: int = 0
    duration_s: float = 60.0
    rate: float = 1.0  # requests per second (Poisson)
    model: str = "model-0"
    prompts: int = 4  # distinct system prompts, chosen uniformly
    system_tokens: int = 768
    user_tokens: tuple[int, int] = (32, 96)
    output_tokens: int = 16


GeneratorParams = (BurstGPTParams | AzureParams | MAFParams | PoissonParams | MixedParams | CsvImportParams
                   | PrefixChatParams | PrefixSystemParams)


class TraceHeader(msgspec.Struct, frozen=True, kw_only=True):
    tidal_trace: int = TRACE_FORMAT_VERSION
    params: GeneratorParams
    num_records: int
    duration_s: float
    time_scale: float = 1.0  # arrival times were divided by this after generation
    adapters: list[AdapterInfo] = []


class Trace(msgspec.Struct, kw_only=True):
    header: TraceHeader
    records: list[TraceRecord]

    def models(self) -> list[str]:
        return sorted({r.model for r in self.records})
