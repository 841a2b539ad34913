"""Where a cold model is started (shared/planner/scale_up.py, pure), and the core tracking the decision."""
from __future__ import annotations

from shared.events import InstanceStats, LayerRange, MemoryHolding, MemoryKind, PoolBreakdown, WorkerState, WorkerStats
from shared.events.plan import PlanApplied, PlanFailed, ScaleUp
from shared.events.registry import ModelRecord
from shared.planner import PlannerCore
from shared.planner.scale_up import ScaleUpPolicy, StartTracker, room_bytes, scale_up_instance_id
from shared.planner.view import ClusterView, WorkerView, worker_view

MODEL = ModelRecord(name="q/7b", path="/m/q", num_layers=4, max_context=128, weight_bytes=1000, layer_bytes=200)


def idle(worker_id: str, *, free: int, prewarm: int = 0, kv: int = 0, warm: dict[str, int] | None = None,
         serves: str | None = None, ts: float = 0.0) -> WorkerView:
    holdings = [MemoryHolding(kind=MemoryKind.PREWARM, owner=f"prewarm/{m}:layer0", bytes=n)
                for m, n in (warm or {}).items()]
    instances = [InstanceStats(instance_id=f"{worker_id}-x", model=serves, layers=LayerRange(start=0, end=2))] \
        if serves else []
    stats = WorkerStats(worker_id=worker_id, seq=0, ts=ts, device="cpu", state=WorkerState.READY,
                        pool=PoolBreakdown(capacity_bytes=free + prewarm + kv, free_bytes=free, prewarm_bytes=prewarm,
                                           kv_bytes=kv, holdings=holdings),
                        instances=instances)
    return worker_view(stats)


def cluster(*workers: WorkerView) -> ClusterView:
    return ClusterView(now=10.0, workers={w.worker_id: w for w in workers}, models={MODEL.name: MODEL})


def test_prewarmed_worker_first_then_most_room_never_one_without_room() -> None:
    policy = ScaleUpPolicy()
    plain = idle("a", free=5000)
    warm = idle("b", free=900, prewarm=300, warm={"q/7b": 200, "other": 100})
    small = idle("c", free=500)
    decision = policy.for_capacity(cluster(plain, warm, small), "q/7b")
    assert decision is not None and isinstance(decision.action, ScaleUp)
    assert decision.action.worker_id == "b" and decision.trigger == "capacity_request"  # 200 B of it warm there
    assert decision.action.instance_id == scale_up_instance_id("b", "q/7b", 10) == "b-q_7b-10"  # the start second
    assert scale_up_instance_id("b", "q/7b") == "b-q_7b"
    assert warm.prewarmed == {"q/7b": 200, "other": 100} and room_bytes(warm) == 1200
    decision = policy.for_capacity(cluster(plain, small), "q/7b")
    assert decision is not None and decision.action.worker_id == "a"  # the most room
    assert policy.for_capacity(cluster(small), "q/7b") is None  # 500 B cannot hold 1000 B of weights
    assert policy.for_capacity(cluster(idle("d", free=5000, serves="q/7b")), "q/7b") is None  # serves it already
    assert policy.for_capacity(cluster(plain), "unknown") is None


def test_the_core_tracks_one_scale_up_per_model_until_its_outcome() -> None:
    policy, core = ScaleUpPolicy(), PlannerCore([], id_prefix="t")
    view = cluster(idle("a", free=5000))
    decision = policy.for_capacity(view, "q/7b")
    assert decision is not None
    (effect,) = core.submit(policy, [decision], view)
    policy.started(effect)
    assert core.submit(policy, [decision], view) == []  # the same instance key is in flight
    assert policy.pending == {"q/7b": effect.plan_id}
    core.on_outcome(PlanApplied(plan_id=effect.plan_id, ts=11.0, duration_s=1.0, commands=1))
    assert policy.pending == {}
    # applied, but the stats do not list the instance yet: no second LoadModel of it onto that worker
    assert policy.tracker.plan_of("q/7b") == effect.plan_id
    assert policy.for_capacity(view, "q/7b") is None
    policy.tracker.refresh(cluster(idle("a", free=5000, serves="q/7b", ts=10.0)))  # stats from before it applied
    assert policy.tracker.count("q/7b") == 1
    policy.tracker.refresh(cluster(idle("a", free=5000, serves="q/7b", ts=11.5)))  # the instance is in the stats

    assert policy.tracker.count("q/7b") == 0


def test_a_failed_start_is_forgotten_and_an_unseen_one_times_out() -> None:
    policy, core = ScaleUpPolicy(StartTracker(seen_timeout_s=5.0)), PlannerCore([], id_prefix="t")
    view = cluster(idle("a", free=5000), idle("b", free=4000))
    first = policy.for_capacity(view, "q/7b")
    (effect,) = core.submit(policy, [first], view)
    policy.started(effect)
    other = policy.for_capacity(view, "q/7b")
    assert other is not None and other.action.worker_id == "b"  # never the worker already starting it
    core.on_outcome(PlanFailed(plan_id=effect.plan_id, ts=11.0, action_index=0, message="refused"))
    assert policy.tracker.count("q/7b") == 0
    (again,) = core.submit(policy, [policy.for_capacity(view, "q/7b")], view)
    policy.started(again)
    core.on_outcome(PlanApplied(plan_id=again.plan_id, ts=12.0, duration_s=1.0, commands=1))
    policy.tracker.refresh(ClusterView(now=16.0, workers=view.workers, models=view.models))
    assert policy.tracker.count("q/7b") == 1  # applied 4 s ago, not in the stats yet: still starting
    policy.tracker.refresh(ClusterView(now=18.0, workers=view.workers, models=view.models))
    assert policy.tracker.count("q/7b") == 0  # never showed up within 5 s: dropped
