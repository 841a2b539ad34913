"""A warm busy worker against a cold idle one (shared/planner/start_cost.py, pure), in both scale-up paths."""
from __future__ import annotations

import pytest

from shared.events import InstanceStats, LayerRange, MemoryHolding, MemoryKind, PoolBreakdown, WorkerState, WorkerStats
from shared.events.plan import PlanApplied, ScaleUp
from shared.events.registry import ModelRecord
from shared.planner.scale_up import ScaleUpPolicy, StartTracker
from shared.planner.start_cost import SAMPLES, StartCosts
from shared.planner.view import ClusterView, WorkerView, worker_view

MODEL = ModelRecord(name="e", path="/m/e", num_layers=4, max_context=128, weight_bytes=1000, layer_bytes=200)


def worker(worker_id: str, *, warm: int = 0, serves: str | None = None, running: int = 0, waiting: int = 0
           ) -> WorkerView:
    holdings = [MemoryHolding(kind=MemoryKind.PREWARM, owner="prewarm/e:layer0", bytes=warm)] if warm else []
    instances = [InstanceStats(instance_id=f"{worker_id}-{serves}", model=serves, layers=LayerRange(start=0, end=2),
                               running=running, waiting=waiting)] if serves else []
    stats = WorkerStats(worker_id=worker_id, seq=0, ts=0.0, device="cpu", state=WorkerState.READY,
                        pool=PoolBreakdown(capacity_bytes=5000, free_bytes=5000 - warm, prewarm_bytes=warm,
                                           holdings=holdings),
                        instances=instances)
    return worker_view(stats)


def test_the_cost_is_the_cold_part_at_the_measured_rate_plus_sharing_the_worker_with_its_busy_requests() -> None:
    costs = StartCosts(default_bytes_per_s=100.0, request_s=2.0, horizon_s=5.0)
    idle_cold, warm_idle = worker("a"), worker("b", warm=1000)
    warm_busy = worker("c", warm=600, serves="d", running=2, waiting=1)
    assert costs.wait_s(idle_cold, "e", 1000) == pytest.approx(10.0)  # 1000 B at 100 B/s, nothing queued
    assert costs.wait_s(warm_idle, "e", 1000) == 0.0
    # 400 B cold at 100 B/s; 3 busy requests: the first request waits 3 x 2 s, the 3 share the worker 5 s more
    assert costs.wait_s(warm_busy, "e", 1000) == pytest.approx(400 / 100 + 3 * (2.0 + 5.0))
    assert costs.busy_requests(warm_busy, "d") == 0.0  # its own instance does not count against it
    # a hot model holding nothing this instant still counts by its recent load per instance
    costs.model_load["d"] = 1.5
    assert costs.busy_requests(worker("c", serves="d"), "e") == 1.5
    # measured starts replace the setting: the median of the recent ones' cold bytes per second
    for cold, seconds in ((1000, 2.0), (1000, 4.0), (2000, 4.0), (0, 1.0), (500, 0.0)):  # no cold bytes, no time: skipped
        costs.observe(cold, seconds)
    assert costs.bytes_per_s == 500.0
    for _ in range(SAMPLES):
        costs.observe(1000, 10.0)
    assert costs.bytes_per_s == 100.0  # only the last SAMPLES count
    with pytest.raises(ValueError):
        StartCosts(request_s=0)
    with pytest.raises(ValueError):
        StartCosts(horizon_s=-1)


def cluster(*workers: WorkerView) -> ClusterView:
    return ClusterView(now=10.0, workers={w.worker_id: w for w in workers}, models={MODEL.name: MODEL})


def test_capacity_path_passes_over_a_warm_worker_whose_queue_costs_more_than_the_cold_start() -> None:
    policy = ScaleUpPolicy(StartTracker(costs=StartCosts(default_bytes_per_s=250.0, request_s=1.0, horizon_s=1.0)))
    cold = worker("a")  # a cold start: 1000 B at 250 B/s = 4 s
    # warm but 3 requests of another model there: 3 x (1 + 1) = 6 s > 4 s -> the cold idle one
    d = policy.for_capacity(cluster(cold, worker("b", warm=1000, serves="d", running=2, waiting=1)), "e")
    assert d is not None and isinstance(d.action, ScaleUp) and d.action.worker_id == "a"
    assert "start cost ~4.0 s" in d.reason
    # warm with 1 request there: 2 s < 4 s -> the warm one (the hit still wins where it is cheaper)
    d = policy.for_capacity(cluster(cold, worker("b", warm=1000, serves="d", running=1)), "e")
    assert d is not None and d.action.worker_id == "b"
    # warm and idle: always
    d = policy.for_capacity(cluster(cold, worker("b", warm=1000)), "e")
    assert d is not None and d.action.worker_id == "b"


def test_an_applied_cold_start_teaches_the_rate_both_paths_rank_by() -> None:
    from shared.planner import PlannerCore

    tracker = StartTracker(costs=StartCosts(default_bytes_per_s=1e9, request_s=1.0, horizon_s=1.0))
    policy, core = ScaleUpPolicy(tracker), PlannerCore([], id_prefix="t")
    busy_warm = worker("b", warm=1000, serves="d", running=1)
    view = cluster(worker("a"), busy_warm)
    d = policy.for_capacity(view, "e")
    assert d is not None and d.action.worker_id == "a"  # at 1 GB/s a cold start is nothing next to 1 s of queue
    (effect,) = core.submit(policy, [d], view)
    policy.started(effect)
    core.on_outcome(PlanApplied(plan_id=effect.plan_id, ts=14.0, duration_s=4.0, commands=1))
    assert tracker.costs.bytes_per_s == 250.0  # it read 1000 B in 4 s
    d = policy.for_capacity(cluster(worker("c"), busy_warm), "e")
    assert d is not None and d.action.worker_id == "b"  # now 2 s of sharing beats a 4 s cold start
