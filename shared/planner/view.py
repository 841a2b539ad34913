"""ClusterView: what the planner knows at one moment, built from worker stats, liveness and the catalog.

Pure data (no I/O, no clock: `now` is an argument). The live planner builds one per interval from
the messages it received (`build_view`); the simulator builds one from its own state. Policies read
it; nothing writes it.
"""
from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

from shared.events.predict import Forecast
from shared.events.registry import ModelRecord
from shared.events.worker import WorkerState, WorkerStats

_EMPTY: Mapping = MappingProxyType({})


@dataclass(frozen=True, slots=True)
class RequestView:
    request_id: str
    prompt_tokens: int = 0
    tokens: int = 0  # prompt + generated so far
    kv_tokens: int = 0  # tokens whose KV is computed
    kv_bytes: int = 0  # KV held now
    projected_kv_bytes: int = 0  # KV at prompt + max_tokens


@dataclass(frozen=True, slots=True)
class InstanceView:
    instance_id: str
    model: str
    worker_id: str
    running: int = 0
    waiting: int = 0
    queued_prompt_tokens: int = 0
    kv_blocks_total: int = 0
    kv_blocks_used: int = 0
    kv_block_bytes: int = 0  # one block: one layer's K and V for a block of tokens
    requests: tuple[RequestView, ...] = ()
    layers: tuple[int, int] = (0, 0)  # [start, end) of the decoder layers whose weights it holds ((0, 0): unknown)
    group_id: str | None = None  # the buddy group it runs a stage of (KunServe)
    kv_growth_blocks_per_s: float = 0.0
    accepting: bool = True  # False: being evicted (draining: WarmServe's grace period)
    tokens_per_s: float = 0.0  # generated over the last stats interval (a running request's decode pace)
    prefill_tokens_per_s: float = 0.0  # its measured prefill pace (0: not measured)
    # prefix caching: cached-free blocks (held by no running request, kept for a later hit; the arbiter's
    # `prefix` source), their bytes, and the recent block hit rate (the chance a cached block is reused)
    prefix_cached_free_blocks: int = 0
    prefix_cached_free_bytes: int = 0
    prefix_hit_rate: float = 0.0

    @property
    def kv_capacity_bytes(self) -> int:
        return self.kv_blocks_total * self.kv_block_bytes

    @property
    def kv_used_bytes(self) -> int:
        return self.kv_blocks_used * self.kv_block_bytes


@dataclass(frozen=True, slots=True)
class AdapterView:
    """A LoRA adapter resident on a worker's device and not pinned: one the pool may evict."""

    adapter: str
    bytes: int
    host_copy: bool = True  # a host copy stays: reloading it reads no disk


@dataclass(frozen=True, slots=True)
class WorkerView:
    worker_id: str
    alive: bool = True
    state: str = WorkerState.READY
    stats_ts: float = 0.0  # when its latest stats were made (0: none yet)
    pool_capacity_bytes: int = 0
    # by MemoryKind value (weights, prewarm, adapter, kv, workspace) and free
    pool_bytes: Mapping[str, int] = field(default_factory=dict)
    instances: tuple[InstanceView, ...] = ()
    prewarmed: Mapping[str, int] = field(default_factory=dict)  # model -> its warm bytes here (kind prewarm)
    adapters: tuple[AdapterView, ...] = ()  # evictable device-resident adapters (the memory arbiter prices them)

    @property
    def usable(self) -> bool:
        """Alive and ready: may be a migration's source or destination."""
        return self.alive and self.state == WorkerState.READY

    @property
    def kv_capacity_bytes(self) -> int:
        """The most KV the worker can hold now: its pool's KV bytes plus its free bytes. Each instance's
        `kv_blocks_total` is what that instance alone could reach in the shared pool, so summing them would
        count the shared KV once per instance."""
        if self.pool_bytes:
            return self.pool_bytes.get("kv", 0) + self.pool_bytes.get("free", 0)
        return sum(i.kv_capacity_bytes for i in self.instances)

    @property
    def kv_used_bytes(self) -> int:
        return sum(i.kv_used_bytes for i in self.instances)

    @property
    def kv_usage(self) -> float:
        """Fraction of the KV blocks in use (0 when it has none)."""
        capacity = self.kv_capacity_bytes
        return self.kv_used_bytes / capacity if capacity else 0.0

    @property
    def requests(self) -> tuple[RequestView, ...]:
        return tuple(r for i in self.instances for r in i.requests)

    def instance_of(self, model: str) -> InstanceView | None:
        return next((i for i in self.instances if i.model == model), None)


@dataclass(frozen=True, slots=True)
class ClusterView:
    now: float
    interval_s: float = 1.0  # the planning interval: budgets below are per interval
    workers: Mapping[str, WorkerView] = field(default_factory=dict)
    models: Mapping[str, ModelRecord] = field(default_factory=dict)  # the catalog
    forecasts: Mapping[str, Forecast] = field(default_factory=dict)  # by model
    # spare bytes per (source, destination) link per interval, for KV migration (MELL's communication boundary)
    link_budget_bytes: Mapping[tuple[str, str], float] = field(default_factory=dict)
    default_link_budget_bytes: float = 0.0  # for links not in the mapping
    # spare prefill tokens per destination per interval, for token migration (MELL's computation boundary)
    prefill_budget_tokens: Mapping[str, float] = field(default_factory=dict)
    default_prefill_budget_tokens: float = 0.0
    # requests waiting in the dispatchers' admission queues, by model (no instance had room for them)
    queued: Mapping[str, int] = field(default_factory=dict)
    # arrivals per second of each LoRA adapter at the dispatchers (their latest stats): how soon a cold one is used
    adapter_rps: Mapping[str, float] = field(default_factory=dict)
    _where: dict[str, tuple[str, str]] = field(default_factory=dict, repr=False, compare=False)

    def __post_init__(self) -> None:
        for worker in self.workers.values():
            for inst in worker.instances:
                for req in inst.requests:
                    self._where[req.request_id] = (worker.worker_id, inst.instance_id)

    def location(self, request_id: str) -> tuple[str, str] | None:
        """(worker_id, instance_id) of a request, None when no worker reports it."""
        return self._where.get(request_id)

    def request(self, request_id: str) -> RequestView | None:
        where = self._where.get(request_id)
        if where is None:
            return None
        inst = next(i for i in self.workers[where[0]].instances if i.instance_id == where[1])
        return next(r for r in inst.requests if r.request_id == request_id)

    def alive(self, worker_id: str) -> bool:
        worker = self.workers.get(worker_id)
        return worker is not None and worker.alive

    def usable_workers(self) -> list[WorkerView]:
        return [w for _, w in sorted(self.workers.items()) if w.usable]

    def link_budget(self, source: str, destination: str) -> float:
        return self.link_budget_bytes.get((source, destination), self.default_link_budget_bytes)

    def prefill_budget(self, worker_id: str, model: str | None = None) -> float:
        """Spare prefill tokens on a destination this interval: its budget less the prompts it has queued.
        The budget is the configured one, or less where `model`'s instance there measured its prefill pace:
        what it computes in one interval (a CPU worker prefills ~250 tokens/s, so the default 4096 tokens
        per 1 s interval would let one move queue 16 s of re-prefill ahead of everyone there)."""
        budget = self.prefill_budget_tokens.get(worker_id, self.default_prefill_budget_tokens)
        worker = self.workers.get(worker_id)
        if worker is None:
            return max(0.0, budget)
        inst = worker.instance_of(model) if model is not None else None
        if inst is not None and inst.prefill_tokens_per_s > 0:
            budget = min(budget, inst.prefill_tokens_per_s * self.interval_s)
        queued = sum(i.queued_prompt_tokens for i in worker.instances)
        return max(0.0, budget - queued)


def worker_view(stats: WorkerStats, *, alive: bool = True) -> WorkerView:
    """A worker as its latest stats describe it."""
    pool = stats.pool
    instances = tuple(
        InstanceView(
            instance_id=i.instance_id, model=i.model, worker_id=stats.worker_id, running=i.running, waiting=i.waiting,
            queued_prompt_tokens=i.queued_prompt_tokens, kv_blocks_total=i.kv_blocks_total,
            kv_blocks_used=i.kv_blocks_used, kv_block_bytes=i.kv_block_bytes,
            layers=(i.layers.start, i.layers.end), group_id=i.group_id, kv_growth_blocks_per_s=i.kv_growth_blocks_per_s,
            accepting=i.accepting, tokens_per_s=i.tokens_per_s, prefill_tokens_per_s=i.prefill_tokens_per_s,
            prefix_cached_free_blocks=i.prefix_cached_free_blocks, prefix_cached_free_bytes=i.prefix_cached_free_bytes,
            prefix_hit_rate=i.prefix_hit_rate,
            requests=tuple(RequestView(r.request_id, r.prompt_tokens, r.tokens, r.kv_tokens, r.kv_bytes,
                                       r.projected_kv_bytes) for r in i.requests),
        )
        for i in stats.instances
    )
    by_kind = {"weights": pool.weights_bytes, "prewarm": pool.prewarm_bytes, "adapter": pool.adapter_bytes,
               "kv": pool.kv_bytes, "workspace": pool.workspace_bytes, "free": pool.free_bytes}
    return WorkerView(worker_id=stats.worker_id, alive=alive, state=str(stats.state), stats_ts=stats.ts,
                      pool_capacity_bytes=pool.capacity_bytes, pool_bytes=MappingProxyType(by_kind),
                      instances=instances, prewarmed=MappingProxyType(prewarmed_models(stats)),
                      adapters=evictable_adapters(stats))


def evictable_adapters(stats: WorkerStats) -> tuple[AdapterView, ...]:
    """Device-resident, unpinned adapters (`adapter_residency`) that no request admitted on the worker
    names (`users == 0`: the worker refuses an `OffloadAdapter` `busy` while one does, and the simulator
    offers only idle adapters too), and whether a host copy stays. Stats from a worker without `users`
    decode as 0: its adapters are offered as before, and a `busy` refusal puts that target off for a
    horizon (the arbiter re-prices from the next view)."""
    host = {r.adapter for r in stats.adapter_residency if r.level == "host"}
    return tuple(AdapterView(r.adapter, r.bytes, r.adapter in host) for r in stats.adapter_residency
                 if r.level == "device" and not r.pinned and r.bytes > 0 and r.users == 0)


def prewarmed_models(stats: WorkerStats) -> dict[str, int]:
    """Warm bytes per model from the pool's prewarm holdings (owner `prewarm/<model>:<part>`)."""
    out: dict[str, int] = {}
    for holding in stats.pool.holdings:
        if holding.kind != "prewarm":
            continue
        part = holding.owner.split("/", 1)[-1]
        model = part.rsplit(":", 1)[0] if ":" in part else part
        out[model] = out.get(model, 0) + holding.bytes
    return out


def build_view(
    now: float, stats: Iterable[WorkerStats], *, dead: Iterable[str] = (), stats_max_age_s: float | None = None,
    interval_s: float = 1.0, models: Mapping[str, ModelRecord] = _EMPTY, forecasts: Mapping[str, Forecast] = _EMPTY,
    link_budget_bytes: Mapping[tuple[str, str], float] = _EMPTY, default_link_budget_bytes: float = 0.0,
    prefill_budget_tokens: Mapping[str, float] = _EMPTY, default_prefill_budget_tokens: float = 0.0,
    queued: Mapping[str, int] = _EMPTY, adapter_rps: Mapping[str, float] = _EMPTY,
) -> ClusterView:
    """The view from each worker's latest stats. A worker is not alive when the registry says it is dead
    (`dead`), or when its stats are older than `stats_max_age_s` (both clocks: the publishers' `ts`)."""
    dead_ids = set(dead)
    workers: dict[str, WorkerView] = {}
    for s in stats:
        fresh = stats_max_age_s is None or now - s.ts <= stats_max_age_s
        workers[s.worker_id] = worker_view(s, alive=fresh and s.worker_id not in dead_ids
                                           and s.state != WorkerState.DEAD)
    return ClusterView(
        now=now, interval_s=interval_s, workers=MappingProxyType(workers), models=models, forecasts=forecasts,
        link_budget_bytes=link_budget_bytes, default_link_budget_bytes=default_link_budget_bytes,
        prefill_budget_tokens=prefill_budget_tokens, default_prefill_budget_tokens=default_prefill_budget_tokens,
        queued=queued, adapter_rps=adapter_rps,
    )


__all__ = [
    "AdapterView", "ClusterView", "InstanceView", "RequestView", "WorkerView", "build_view", "evictable_adapters",
    "prewarmed_models", "worker_view",
]
