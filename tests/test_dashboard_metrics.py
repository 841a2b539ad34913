"""The metrics the dashboard adds: the gateway's TPOT per finished choice, the worker's pool/load gauges
mirrored from its WorkerStats (stale instances removed), and migrations counted by mode and outcome."""
from __future__ import annotations

import msgspec

from services.gateway.streaming import Metering
from services.gpu_worker.metrics import export_stats, record_migration
from shared.events import InstanceStats, LayerRange, PoolBreakdown, TokenChunk, Usage, WorkerState, WorkerStats
from shared.events.ctl import CtlDone, CtlRefused, MigrateOut, MigrationReport
from shared.metrics import REGISTRY

ROUTE = "/v1/completions"


def value(name: str, **labels: str) -> float | None:
    return REGISTRY.get_sample_value(name, labels)


def chunk(seq: int, tokens: list[int], final: bool = False) -> TokenChunk:
    if final:
        return TokenChunk(request_id="r", seq=seq, token_ids=tokens, finish_reason="length",
                          usage=Usage(prompt_tokens=3, completion_tokens=4))
    return TokenChunk(request_id="r", seq=seq, token_ids=tokens)


def test_tpot_is_observed_once_per_finished_choice_with_tokens_after_the_first_chunk():
    before = value("tidal_gateway_tpot_seconds_count", route=ROUTE) or 0.0
    meter = Metering(ROUTE, arrival=0.0)
    for seq, tokens in enumerate([[1], [2], [3]]):
        meter.saw(chunk(seq, tokens), choice=0)
    meter.saw(chunk(0, [7]), choice=1)
    meter.saw(chunk(3, [4], final=True), choice=0)
    assert value("tidal_gateway_tpot_seconds_count", route=ROUTE) == before + 1
    meter.saw(chunk(1, [], final=True), choice=1)  # one token only: no time per output token
    assert value("tidal_gateway_tpot_seconds_count", route=ROUTE) == before + 1


def stats(*instances: str) -> WorkerStats:
    return WorkerStats(
        worker_id="wm", seq=1, ts=1.0, device="cpu", state=WorkerState.READY,
        pool=PoolBreakdown(capacity_bytes=1000, weights_bytes=300, adapter_bytes=50, kv_bytes=500, free_bytes=150),
        instances=[InstanceStats(instance_id=i, model="m", layers=LayerRange(start=0, end=2), running=2, waiting=3,
                                 kv_blocks_total=10, kv_blocks_used=4) for i in instances],
    )


def test_worker_gauges_mirror_the_stats_and_drop_instances_that_left():
    export_stats(stats("wm-a", "wm-b"))
    assert value("tidal_worker_pool_bytes", worker="wm", kind="weights") == 300
    assert value("tidal_worker_pool_bytes", worker="wm", kind="free") == 150
    assert value("tidal_worker_pool_capacity_bytes", worker="wm") == 1000
    labels = {"worker": "wm", "model_instance": "wm-b", "model": "m"}
    assert value("tidal_worker_waiting_sequences", **labels) == 3
    assert value("tidal_worker_kv_blocks_used", **labels) == 4
    assert value("tidal_worker_kv_blocks_capacity", **labels) == 10
    export_stats(stats("wm-a"))
    assert value("tidal_worker_waiting_sequences", **labels) is None
    assert value("tidal_worker_running_sequences", worker="wm", model_instance="wm-a", model="m") == 2


def test_migrations_are_counted_by_mode_and_outcome():
    out = MigrateOut(idempotency_key="k", request_id="r", destination="w2", destination_instance="w2-m", mode="kv")
    done = CtlDone(idempotency_key="k", command="MigrateOut", worker_id="wm",
                   migration=MigrationReport(requested_mode="kv", mode="tokens", downtime_s=0.02))
    refused = CtlRefused(idempotency_key="k", command="MigrateOut", worker_id="wm", code="busy", message="no")
    before = value("tidal_worker_migrations_total", worker="wm", mode="tokens", outcome="done") or 0.0
    record_migration("wm", out, done)
    record_migration("wm", out, refused)
    assert value("tidal_worker_migrations_total", worker="wm", mode="tokens", outcome="done") == before + 1
    assert value("tidal_worker_migrations_total", worker="wm", mode="kv", outcome="busy") >= 1
    assert value("tidal_worker_migration_downtime_seconds_count", mode="tokens") >= 1


def test_cached_prefix_blocks_are_a_pool_kind_and_a_gauge():
    s = stats("wp-a")
    s.instances[0] = msgspec.structs.replace(s.instances[0], kv_block_bytes=10, prefix_cached_free_bytes=60,
                                             prefix_hit_rate=0.5)
    export_stats(msgspec.structs.replace(s, worker_id="wp"))
    assert value("tidal_worker_pool_bytes", worker="wp", kind="kv_cached") == 60
    assert value("tidal_worker_pool_bytes", worker="wp", kind="kv") == 500 - 60  # the kinds still sum to capacity
    labels = {"worker": "wp", "model_instance": "wp-a", "model": "m"}
    assert value("tidal_worker_kv_blocks_cached", **labels) == 6
    assert value("tidal_worker_prefix_hit_rate", **labels) == 0.5
