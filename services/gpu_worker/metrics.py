"""The worker's pool, load and migrations as Prometheus metrics, for dashboards.

The gauges mirror the `WorkerStats` the worker publishes (`export_stats` is called with each
one), so a dashboard and `tidal status` show the same numbers. Instance label sets that leave
the stats (an instance unloaded) are removed. The label `model_instance` is not `instance`,
which Prometheus sets to the scrape target.
"""
from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

from shared.events import WorkerStats
from shared.events.ctl import CtlDone, CtlRefused, MigrateOut
from shared.metrics import REGISTRY

_POOL_FIELDS = {"weights": "weights_bytes", "prewarm": "prewarm_bytes", "adapter": "adapter_bytes",
                "kv": "kv_bytes", "workspace": "workspace_bytes", "free": "free_bytes"}
_INSTANCE_LABELS = ["worker", "model_instance", "model"]

POOL_BYTES = Gauge(
    "tidal_worker_pool_bytes",
    "Device pool bytes by kind (weights, prewarm, adapter, kv, kv_cached, workspace, free); kv_cached: free KV "
    "blocks holding a cached prompt prefix (evicted on demand), not counted in kv, so the kinds sum to capacity",
    ["worker", "kind"], registry=REGISTRY,
)
POOL_CAPACITY = Gauge("tidal_worker_pool_capacity_bytes", "Device pool capacity", ["worker"], registry=REGISTRY)
RUNNING = Gauge("tidal_worker_running_sequences", "Sequences in the instance's batch", _INSTANCE_LABELS,
                registry=REGISTRY)
WAITING = Gauge("tidal_worker_waiting_sequences", "Requests admitted to the instance, not yet scheduled (its queue)",
                _INSTANCE_LABELS, registry=REGISTRY)
KV_USED = Gauge("tidal_worker_kv_blocks_used", "KV blocks in use by the instance", _INSTANCE_LABELS, registry=REGISTRY)
KV_CACHED = Gauge("tidal_worker_kv_blocks_cached",
                  "KV blocks held only by the prefix cache (free, evicted on demand, LRU first)", _INSTANCE_LABELS,
                  registry=REGISTRY)
PREFIX_HIT_RATE = Gauge("tidal_worker_prefix_hit_rate", "Share of looked-up prompt blocks found in the prefix cache "
                        "(recent)", _INSTANCE_LABELS, registry=REGISTRY)
KV_TOTAL = Gauge("tidal_worker_kv_blocks_capacity", "KV blocks the instance can use", _INSTANCE_LABELS, registry=REGISTRY)
TOKENS_PER_S = Gauge("tidal_worker_tokens_per_second", "Tokens generated per second over the last stats interval",
                     _INSTANCE_LABELS, registry=REGISTRY)
MIGRATIONS = Counter(
    "tidal_worker_migrations_total",
    "MigrateOut commands this worker (the source) finished, by mode (kv, tokens; the requested mode when refused) "
    "and outcome (done, or the refusal code)",
    ["worker", "mode", "outcome"], registry=REGISTRY,
)
MIGRATION_DOWNTIME = Histogram(
    "tidal_worker_migration_downtime_seconds", "Time a migrated request generated nowhere, by mode", ["mode"],
    buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0), registry=REGISTRY,
)

# vLLM's engine gauges, by vLLM's labels (model_name; engine: the instance), for dashboards and autoscaling
# rules written for vLLM (the gateway has vLLM's request histograms: services/gateway/vllm_metrics.py)
_VLLM_LABELS = ["model_name", "engine"]
VLLM_RUNNING = Gauge("vllm:num_requests_running", "Number of requests in model execution batches.", _VLLM_LABELS,
                     registry=REGISTRY)
VLLM_WAITING = Gauge("vllm:num_requests_waiting", "Number of requests waiting to be processed.", _VLLM_LABELS,
                     registry=REGISTRY)
VLLM_CACHE = Gauge("vllm:gpu_cache_usage_perc", "GPU KV-cache usage. 1 means 100 percent usage.", _VLLM_LABELS,
                   registry=REGISTRY)

_exported: set[tuple[str, str, str]] = set()


def export_stats(stats: WorkerStats) -> None:
    """Set the gauges from one WorkerStats (extra fields a later WorkerStats may carry are ignored)."""
    worker, pool = stats.worker_id, stats.pool
    POOL_CAPACITY.labels(worker).set(pool.capacity_bytes)
    cached = min(pool.kv_bytes, sum(getattr(i, "prefix_cached_free_bytes", 0) for i in stats.instances))
    for kind, field in _POOL_FIELDS.items():
        POOL_BYTES.labels(worker, kind).set(getattr(pool, field) - (cached if kind == "kv" else 0))
    POOL_BYTES.labels(worker, "kv_cached").set(cached)
    current: set[tuple[str, str, str]] = set()
    for inst in stats.instances:
        labels = (worker, inst.instance_id, inst.model)
        current.add(labels)
        RUNNING.labels(*labels).set(inst.running)
        WAITING.labels(*labels).set(inst.waiting)
        KV_USED.labels(*labels).set(inst.kv_blocks_used)
        KV_TOTAL.labels(*labels).set(inst.kv_blocks_total)
        cached_bytes = getattr(inst, "prefix_cached_free_bytes", 0)
        KV_CACHED.labels(*labels).set(cached_bytes // inst.kv_block_bytes if inst.kv_block_bytes else 0)
        PREFIX_HIT_RATE.labels(*labels).set(getattr(inst, "prefix_hit_rate", 0.0))
        TOKENS_PER_S.labels(*labels).set(inst.tokens_per_s)
        VLLM_RUNNING.labels(inst.model, inst.instance_id).set(inst.running)
        VLLM_WAITING.labels(inst.model, inst.instance_id).set(inst.waiting)
        VLLM_CACHE.labels(inst.model, inst.instance_id).set(
            inst.kv_blocks_used / inst.kv_blocks_total if inst.kv_blocks_total else 0.0)
    for labels in _exported - current:
        for gauge in (RUNNING, WAITING, KV_USED, KV_CACHED, PREFIX_HIT_RATE, KV_TOTAL, TOKENS_PER_S):
            try:
                gauge.remove(*labels)
            except KeyError:
                pass
        for gauge in (VLLM_RUNNING, VLLM_WAITING, VLLM_CACHE):
            try:
                gauge.remove(labels[2], labels[1])
            except KeyError:
                pass
    _exported.clear()
    _exported.update(current)


def record_migration(worker: str, msg: MigrateOut, reply: object) -> None:
    """Count one finished MigrateOut (its CtlDone or CtlRefused reply)."""
    if isinstance(reply, CtlDone) and reply.migration is not None:
        MIGRATIONS.labels(worker, reply.migration.mode, "done").inc()
        MIGRATION_DOWNTIME.labels(reply.migration.mode).observe(reply.migration.downtime_s)
    elif isinstance(reply, CtlRefused):
        MIGRATIONS.labels(worker, msg.mode, reply.code).inc()
