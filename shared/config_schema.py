"""The cluster config's schema: typed, frozen msgspec Structs, one per TOML section (shared/config.py loads them).

Kept apart from the loading (config_loader.py), which reads these types: the loader imports the
schema, the schema imports nothing of the loader, so neither imports the other back.
"""
from __future__ import annotations

import re
from pathlib import Path
from typing import Annotated, Literal

import msgspec
from msgspec import Meta

from shared.config_units import Bandwidth, ByteSize, Duration, SloTarget
from shared.events.base import ID_PATTERN, MAX_OUTPUT_TOKENS, MAX_PROMPT_TOKENS, NAME_PATTERN

DEFAULT_CONFIG_PATH = Path(__file__).with_name("default_cluster.toml")


class ConfigError(ValueError):
    """A config file or override was refused: `key_path` (e.g. "workers[1].memory") and what was wrong."""

    def __init__(self, key_path: str, detail: str, *, source: str = "") -> None:
        self.key_path = key_path
        self.detail = detail
        self.source = source
        where = f"{key_path}: " if key_path else ""
        origin = f" (in {source})" if source else ""
        super().__init__(f"config error: {where}{detail}{origin}")

Name = Annotated[str, Meta(pattern=NAME_PATTERN)]
Ident = Annotated[str, Meta(pattern=ID_PATTERN)]
Port = Annotated[int, Meta(ge=1, le=65535)]
Fraction = Annotated[float, Meta(ge=0, le=1)]
PositiveInt = Annotated[int, Meta(ge=1, le=2**31 - 1)]
Dtype = Literal["float32", "bfloat16", "float16"]
DEVICE_PATTERN = r"^(cpu|cuda:[0-9]{1,3})$"
Device = Annotated[str, Meta(pattern=DEVICE_PATTERN)]


class Section(msgspec.Struct, forbid_unknown_fields=True, frozen=True, kw_only=True):
    """Every config table: unknown keys are refused; unit-typed defaults get their unit type."""

    def __post_init__(self) -> None:
        for name, unit in _unit_fields(type(self)):
            value = getattr(self, name)
            if value is not None and not isinstance(value, unit):
                msgspec.structs.force_setattr(self, name, unit.parse(value))


def _unit_fields(cls: type) -> list[tuple[str, type]]:
    cached = _UNIT_FIELDS.get(cls)
    if cached is None:
        cached = []
        for field in msgspec.structs.fields(cls):
            for unit in (ByteSize, Duration, SloTarget, Bandwidth):
                if field.type is unit or unit in getattr(field.type, "__args__", ()):
                    cached.append((field.name, unit))
        _UNIT_FIELDS[cls] = cached
    return cached


_UNIT_FIELDS: dict[type, list[tuple[str, type]]] = {}


class ClusterSection(Section, kw_only=True):
    name: Ident = "tidal"
    nats_url: str = "embedded"  # "embedded": `tidal up` starts nats-server; else nats://[user:pass@]host:port
    data_dir: str = ".tidal"  # generated models, NATS store, logs

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.nats_url != "embedded":
            for url in self.nats_url.split(","):
                if not re.match(r"^(nats|tls|ws|wss)://[^\s/]+$", url.strip()):
                    raise ValueError(f'nats_url: expected "embedded" or nats://[user:pass@]host:port, got {url!r}')

    @property
    def embedded_nats(self) -> bool:
        return self.nats_url == "embedded"


class GatewayLimits(Section, kw_only=True):
    max_body_bytes: ByteSize = 1 << 20
    max_prompt_tokens: Annotated[int, Meta(ge=1, le=MAX_PROMPT_TOKENS)] = 8192
    max_tokens: Annotated[int, Meta(ge=1, le=MAX_OUTPUT_TOKENS)] = 4096
    max_n: Annotated[int, Meta(ge=1, le=128)] = 8
    max_adapters_per_request: Annotated[int, Meta(ge=0, le=16)] = 1
    max_stop_sequences: Annotated[int, Meta(ge=0, le=16)] = 4
    request_timeout: Duration = 600.0
    # a request with no message (token, error) for this long is ended with an error (503 stream_stalled):
    # a defence against a lost request; above any queue wait for capacity. 0 turns it off
    stream_stall_timeout: Duration = 300.0


class RateLimit(Section, kw_only=True):
    """Per API key, token bucket; 0 disables."""

    requests_per_s: Annotated[float, Meta(ge=0)] = 0.0
    burst: Annotated[int, Meta(ge=0)] = 0  # 0: max(1, ceil(requests_per_s))


class GatewaySection(Section, kw_only=True):
    host: str = "127.0.0.1"
    port: Port = 8000
    api_keys: Annotated[list[Annotated[str, Meta(min_length=8, max_length=256)]], Meta(max_length=1024)] = []
    limits: GatewayLimits = msgspec.field(default_factory=GatewayLimits)
    rate_limit: RateLimit = msgspec.field(default_factory=RateLimit)
    drain_timeout: Duration = 30.0
    # POST /v1/load_lora_adapter and /v1/unload_lora_adapter (vLLM's VLLM_ALLOW_RUNTIME_LORA_UPDATING):
    # they make the workers read any local path they are given, so off unless a config turns them on
    allow_runtime_lora_updating: bool = False


class DispatcherSection(Section, kw_only=True):
    queue_bound: PositiveInt = 256  # per model
    # a request for a catalog model no live instance serves waits in its queue (past queue_bound: 503 +
    # Retry-After) while the planner is asked to start one (WarmServe scale-from-zero); false: 503 at once
    scale_from_zero: bool = False
    max_redispatches: Annotated[int, Meta(ge=0, le=100)] = 2
    # rank_aware: CaraServe Alg. 1; most_idle, first_fit, random: its baselines (docs/caraserve.md);
    # mell: the planner's placement hints (MELL's Allocate), else least load -- recommended with the
    # planner on and [policies] migration != "off" (docs/planner.md)
    routing_policy: Literal["least_load", "rank_aware", "most_idle", "first_fit", "random", "mell"] = "least_load"
    lora_profile: str | None = None  # `tidal profile lora`'s file for rank_aware; None: the paper's numbers
    # prefix-aware routing (docs/serving.md): where an instance holds a request's leading KV blocks (the
    # workers' PrefixSummary), cost = prefix_weight x uncached prompt tokens + the instance's outstanding
    # tokens (Dynamo's KV router); where none does, routing_policy decides as without it. false: off
    prefix_routing: bool = True
    prefix_weight: Annotated[float, Meta(ge=0, le=1000)] = 1.0
    assign_timeout: Duration = 2.0
    stats_interval: Duration = 1.0


class PlannerSection(Section, kw_only=True):
    enabled: bool = True
    interval: Duration = 1.0
    kv_high_watermark: Fraction = 0.9  # above: buy memory (the memory economy)
    kv_low_watermark: Fraction = 0.5  # below: give it back (restore layers, scale down)
    max_migrations_per_op: Annotated[int, Meta(ge=0, le=1000)] = 10  # MELL's bound
    # the KV packer the planner places requests with (docs/planner.md): repackfit (ours, shared/policy/packer.py:
    # never more GPUs than MELL at equal service in `tidal repro mell`) or mell (MELL's classes)
    packer: Literal["repackfit", "mell"] = "repackfit"
    # MELL §V boundaries, per planning interval: KV bytes one link may carry for migrations, and
    # prompt tokens a destination may re-prefill for token-mode migrations
    migration_link_budget: ByteSize = 256 << 20
    migration_prefill_budget: PositiveInt = 4096
    # MELL's consolidation (moving requests off a worker that is not above the watermark, to pack fewer
    # workers): "auto" only when the dispatcher places new requests where MELL would ([dispatcher]
    # routing_policy = "mell"); under a load-spreading router every request the router spreads is moved back
    # (a tug of war, and on CPU workers the packed worker's decode slows while the other idles). KV-pressure
    # moves (off a worker above kv_high_watermark) run whatever this says.
    consolidate: Literal["auto", "on", "off"] = "auto"
    ctl_timeout: Duration = 30.0  # a control command's deadline (a migration is answered when it is over)
    lease_ttl: Duration = 3.0  # one planner decides: a standby takes over after the lease is this stale
    # WarmServe (docs/warmserve.md): the autoscaler (shared/policy/autoscaler.py: the public code's
    # 0.8/0.5 thresholds over a 5 s window, 5 s protect period) scales instances on load, and the
    # predictor's forecasts prewarm replicas (with [policies] prewarm); off: instances change only
    # on capacity requests
    autoscale: bool = False
    request_time: Duration = 2.0  # a request's mean time in the system: forecast rps -> concurrent requests
    # with autoscale: instances each catalog model keeps however idle it is (0: scale to zero, which needs
    # [dispatcher] scale_from_zero), and how long an instance must have been idle before it is stopped
    # (Ollama's keep_alive; 0: at once, the public WarmServe rule)
    min_instances: Annotated[int, Meta(ge=0, le=64)] = 0
    keep_alive: Duration = 0.0
    # with autoscale: also scale out on measured saturation (requests waiting per instance over the window,
    # the decode pace per request below the [slo] tpot), not only on requests against max_batch_size
    scale_on_saturation: bool = False
    # The memory economy (docs/planner.md): "fixed-order" asks the policies cheapest source first, each
    # blind to the others' prices; "arbiter" prices every offer in request-seconds and buys per need
    economy: Literal["fixed-order", "arbiter"] = "fixed-order"
    horizon: Duration = 10.0  # arbiter: needs and prices look this far ahead
    # arbiter: the simulator cost profile whose links and movement price moves, loads and restores (a
    # .toml/.json path, or a built-in name of loadgen/sim/profiles)
    cost_profile: Annotated[str, Meta(min_length=1, max_length=1024)] = "cpu"

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.kv_low_watermark >= self.kv_high_watermark:
            raise ValueError("kv_low_watermark must be below kv_high_watermark")
        if self.lease_ttl <= self.interval:
            raise ValueError("lease_ttl must be longer than interval (the leader renews once per interval)")


class PredictorSection(Section, kw_only=True):
    window: Duration = 60.0
    season: Duration = 86400.0  # the periodicity the seasonal predictor looks back by
    history_windows: PositiveInt = 10080
    peak_slot: Duration = 10.0  # a window's peak rate is its busiest slot of this length (>= stats_interval)
    lookback: Annotated[int, Meta(ge=1, le=64)] = 10  # N of WarmServe Eq. 3: recent windows in the correction

    def __post_init__(self) -> None:
        super().__post_init__()
        per = self.season / self.window
        if abs(per - round(per)) > 1e-6:
            raise ValueError(f"season ({self.season}s) must be a whole number of windows ({self.window}s)")
        if self.peak_slot > self.window:
            raise ValueError(f"peak_slot ({self.peak_slot}s) must not be longer than window ({self.window}s)")


class RegistrySection(Section, kw_only=True):
    heartbeat_interval: Duration = 1.0  # how often workers and services send heartbeats
    dead_after: Duration = 3.0  # no heartbeat for this long: marked dead
    kv_history: Annotated[int, Meta(ge=1, le=64)] = 5
    replicas: Annotated[int, Meta(ge=1, le=5)] = 1  # JetStream replicas of the KV buckets

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.dead_after <= self.heartbeat_interval:
            raise ValueError("dead_after must be longer than heartbeat_interval")


class DemoModel(Section, kw_only=True):
    """A small random-weight checkpoint `tidal make-model` generates (cached under data_dir)."""

    arch: Literal["llama", "qwen2"]
    layers: Annotated[int, Meta(ge=1, le=64)] = 4
    hidden: Annotated[int, Meta(ge=8, le=8192)] = 128
    heads: Annotated[int, Meta(ge=1, le=128)] = 4
    kv_heads: Annotated[int, Meta(ge=1, le=128)] = 2
    intermediate: Annotated[int, Meta(ge=8, le=32768)] = 352
    vocab: Annotated[int, Meta(ge=256, le=262144)] = 2048
    seed: Annotated[int, Meta(ge=0)] = 0


class GgufSource(Section, kw_only=True):
    """A llama.cpp GGUF file imported once (`tidal import-gguf`) into data_dir/models/<name>."""

    file: Annotated[str, Meta(min_length=1)]  # a path, or with `package` a file inside that package
    package: Annotated[str, Meta(pattern=r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*$")] | None = None


class ModelSpec(Section, kw_only=True):
    name: Name
    path: str | None = None  # a local Hugging Face directory; generated here when `demo` or `gguf` is set
    demo: DemoModel | None = None
    gguf: GgufSource | None = None
    dtype: Dtype = "float32"
    max_context: Annotated[int, Meta(ge=16, le=2**24)] = 2048

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.demo is not None and self.gguf is not None:
            raise ValueError("a model takes `demo` or `gguf`, not both")


class DemoAdapter(Section, kw_only=True):
    seed: Annotated[int, Meta(ge=0)] = 0


class AdapterSpec(Section, kw_only=True):
    name: Name
    base: Name
    path: str | None = None  # a PEFT directory; generated here when `demo` is set
    demo: DemoAdapter | None = None
    rank: Annotated[int, Meta(ge=1, le=1024)] = 8
    targets: Annotated[list[Annotated[str, Meta(pattern=r"^[A-Za-z0-9_]{1,32}$")]], Meta(min_length=1)] = msgspec.field(
        default_factory=lambda: ["q_proj", "v_proj"]
    )


class WorkerSpec(Section, kw_only=True):
    id: Ident
    device: Device = "cpu"
    memory: ByteSize  # the pool's capacity (on CUDA: at most the free HBM)
    models: list[Name] = []  # instances to load at start
    adapters: list[Name] = []  # adapters to make resident at start
    # host repository of LoRA adapters (per instance): beyond it the least recently used are
    # dropped from memory and read from their directory again on use; None: unbounded
    lora_host_memory: ByteSize | None = None
    # CaraServe: CPU LoRA processes per instance; with [policies] cpu_lora_assist a cold adapter's
    # prefill runs on them while it loads (docs/caraserve.md). 0: none
    cpu_lora_processes: Annotated[int, Meta(ge=0, le=256)] = 2
    # Paces adapter loads to this rate ("16GB/s"): on a CPU worker the "device copy" is a memory
    # copy, so this simulates a PCIe-like link for tests and demos. Unset: not paced.
    lora_load_bandwidth: Bandwidth | None = None
    # A request's tokens after its first are held up to about this long and sent together, one
    # chunk per request per flush (vLLM's stream_interval, in time): fewer messages per token on
    # every hop (docs/benchmarks.md "## gateway"). 0: one chunk per request per engine step.
    stream_interval: Duration = 0.02
    # Each engine step lasts at least this long ("10ms", a GPU decode step's order): a CPU worker's tiny
    # model steps in ~0.2 ms, so its requests end before a planner interval sees them; with a floor the
    # elastic mechanisms (migrations, drains, re-dispatch) act on running requests in tests and demos,
    # as they would at a device's pace. 0: as fast as the device runs.
    min_step_time: Duration = 0.0
    # WarmServe: an evicted instance's weights stay in the pool as prewarmed (kind prewarm) this long,
    # so a LoadModel of the model meanwhile starts on them; 0: freed at once. Any catalog model may be
    # loaded at run time: `models` above is the initial placement, not a limit (docs/warmserve.md).
    grace_period: Duration = 30.0


class PoliciesSection(Section, kw_only=True):
    max_batch_size: Annotated[int, Meta(ge=1, le=4096)] = 64
    step_token_budget: Annotated[int, Meta(ge=16, le=1 << 20)] = 2048  # chunked prefill
    # How the engine builds a step (docs/engine-scheduling.md): "chunked" (decodes first, then prefill
    # chunks within the budget) or "vllm-0.6" (what the papers' baselines ran: prefill-first, whole
    # prompts, so step_token_budget must cover a model's max_context; watermark; recompute preemption)
    scheduling: Literal["chunked", "vllm-0.6"] = "chunked"
    kv_block_tokens: Annotated[int, Meta(ge=1, le=1024)] = 16
    # automatic prefix caching in the engine (docs/engine-scheduling.md): full KV blocks of a prompt
    # prefix are shared between requests and kept after them (LRU) for a later hit; false: every prompt
    # is prefilled from token 0
    prefix_caching: bool = True
    lora_kernel: Literal["padded", "segmented"] = "segmented"
    max_lora_rank: Annotated[int, Meta(ge=1, le=1024)] = 64  # adapters of a higher rank are refused at load
    cpu_lora_assist: bool = True  # CaraServe: cold adapters prefill on CPU while loading
    buddy_groups: bool = True  # KunServe: drop layers under KV pressure
    # KunServe's pipeline cost model: a built-in profile's name (shared/profiles/) or a .toml/.json path
    kunserve_profile: Annotated[str, Meta(min_length=1, max_length=1024)] = "kunserve-qwen2.5-14b-a800"
    prewarm: bool = True  # WarmServe
    migration: Literal["auto", "kv", "tokens", "off"] = "auto"  # MELL


class SloSection(Section, kw_only=True):
    ttft: SloTarget = "5x"  # type: ignore[assignment]  # parsed by Section.__post_init__
    tpot: SloTarget = "5x"  # type: ignore[assignment]
    attainment: Fraction = 0.9


class ObservabilitySection(Section, kw_only=True):
    log_level: Literal["debug", "info", "warning", "error"] = "info"
    log_format: Literal["json", "console"] = "json"
    tracing: Literal["off", "console", "otlp"] = "off"
    otlp_endpoint: str = "http://127.0.0.1:4317"
    metrics_host: str = "127.0.0.1"
    # 0: every process serves /metrics on a free port (reported in its health and registry record);
    # N: gateway N, dispatcher N+1, planner N+2, predictor N+3, registry N+4, worker i N+10+i.
    metrics_port_base: Annotated[int, Meta(ge=0, le=65000)] = 0

    def metrics_port(self, service: str, index: int = 0) -> int:
        if self.metrics_port_base == 0:
            return 0
        order = ("gateway", "dispatcher", "planner", "predictor", "registry")
        offset = 10 + index if service == "gpu_worker" else order.index(service)
        return self.metrics_port_base + offset


class ClusterConfig(Section, kw_only=True):
    cluster: ClusterSection = msgspec.field(default_factory=ClusterSection)
    gateway: GatewaySection = msgspec.field(default_factory=GatewaySection)
    dispatcher: DispatcherSection = msgspec.field(default_factory=DispatcherSection)
    planner: PlannerSection = msgspec.field(default_factory=PlannerSection)
    predictor: PredictorSection = msgspec.field(default_factory=PredictorSection)
    registry: RegistrySection = msgspec.field(default_factory=RegistrySection)
    models: list[ModelSpec] = []
    adapters: list[AdapterSpec] = []
    workers: list[WorkerSpec] = []
    policies: PoliciesSection = msgspec.field(default_factory=PoliciesSection)
    slo: SloSection = msgspec.field(default_factory=SloSection)
    observability: ObservabilitySection = msgspec.field(default_factory=ObservabilitySection)

    def model(self, name: str) -> ModelSpec:
        for spec in self.models:
            if spec.name == name:
                return spec
        raise KeyError(name)

    def adapter(self, name: str) -> AdapterSpec:
        for spec in self.adapters:
            if spec.name == name:
                return spec
        raise KeyError(name)

    def worker(self, worker_id: str) -> WorkerSpec:
        for spec in self.workers:
            if spec.id == worker_id:
                return spec
        raise KeyError(worker_id)


__all__ = [
    "DEFAULT_CONFIG_PATH", "DEVICE_PATTERN", "AdapterSpec", "ClusterConfig", "ClusterSection", "ConfigError",
    "DemoAdapter", "DemoModel", "DispatcherSection", "GatewayLimits", "GatewaySection", "GgufSource", "ModelSpec",
    "ObservabilitySection", "PlannerSection", "PoliciesSection", "PredictorSection", "RateLimit", "RegistrySection",
    "Section", "SloSection", "WorkerSpec",
]
