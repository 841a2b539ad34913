"""WarmServe as a planner policy (shared/planner/warmserve_policy.py), on constructed views: the public code's
autoscaler (load over its window -> scale-up onto the prewarmed worker; idle -> scale-down after the protect
period), one LoadModel per decision, Alg. 1 prewarms from the forecasts, proactive prewarming capped at Eq. 1's
target, `prewarm = false`, the lifecycle labels."""
from __future__ import annotations

from types import MappingProxyType

import pytest

from shared.events.ctl import EvictModel, Prewarm
from shared.events.plan import PlacePrewarm, PlanApplied, ReleasePrewarm, ScaleDown, ScaleUp
from shared.events.predict import Forecast
from shared.events.registry import ModelRecord
from shared.planner import PlannerCore, ctl_commands
from shared.planner.policy import Busy
from shared.planner.scale_up import ScaleUpPolicy
from shared.planner.view import ClusterView, InstanceView, WorkerView
from shared.planner.warmserve_policy import WarmServePolicy, WarmServeSettings
from shared.planner.warmserve_view import lifecycle_label, lifecycle_of
from shared.policy.warmserve import reservation_target

A = ModelRecord(name="a", path="/m/a", num_layers=4, max_context=128, weight_bytes=1000, layer_bytes=200)
B = ModelRecord(name="b", path="/m/b", num_layers=4, max_context=128, weight_bytes=2000, layer_bytes=400)
CAP = 10_000  # every worker's pool
SETTINGS = WarmServeSettings(batch_size=4, mean_request_s=1.0)  # the autoscaler: B 4, 0.8 / 0.5, 5 s window and protect


def inst(worker: str, model: str, *, running: int = 0, waiting: int = 0, accepting: bool = True,
         kv_used_blocks: int = 0) -> InstanceView:
    return InstanceView(instance_id=f"{worker}-{model}", model=model, worker_id=worker, running=running,
                        waiting=waiting, kv_blocks_total=60, kv_blocks_used=kv_used_blocks, kv_block_bytes=100,
                        accepting=accepting)


def wv(worker: str, *instances: InstanceView, warm: dict[str, int] | None = None, kv: int = 0) -> WorkerView:
    warm = warm or {}
    weights = sum({"a": A, "b": B}[i.model].weight_bytes for i in instances)
    prewarm = sum(warm.values())
    pool = {"weights": weights, "prewarm": prewarm, "adapter": 0, "kv": kv, "workspace": 0,
            "free": CAP - weights - prewarm - kv}
    return WorkerView(worker_id=worker, pool_capacity_bytes=CAP, pool_bytes=MappingProxyType(pool),
                      instances=instances, prewarmed=MappingProxyType(warm))


def fc(model: str, avg: float, peak: float, now: float = 100.0) -> Forecast:
    return Forecast(model=model, predictor_id="p", issued_ts=now, window_start_ts=now, window_s=10.0, avg_rps=avg,
                    peak_rps=peak)


def view(now: float, *workers: WorkerView, forecasts: tuple[Forecast, ...] = (), queued: int = 0) -> ClusterView:
    return ClusterView(now=now, workers={w.worker_id: w for w in workers}, models={"a": A, "b": B},
                       forecasts={f.model: f for f in forecasts}, queued={"a": queued} if queued else {})


def actions(decisions: list, kind: type) -> list:
    return [d.action for d in decisions if isinstance(d.action, kind)]


def test_load_above_80_percent_over_the_window_scales_up_onto_the_worker_holding_it_warm() -> None:
    policy = WarmServePolicy(SETTINGS)
    workers = (wv("w0", inst("w0", "a", running=4, waiting=2)), wv("w1"), wv("w2", warm={"a": 1000}))
    for t in (100.0, 101.0, 102.0):  # 6 requests from t = 100: the 5 s average passes 0.8 x 4 = 3.2 at 102.7
        assert actions(policy.decide(view(t, *workers), Busy(())), ScaleUp) == [], t
    decisions = policy.decide(view(103.0, *workers), Busy(()))
    ups = actions(decisions, ScaleUp)
    # load 3.6 -> ceil(3.6 / 0.8 / 4) = 2 instances, 1 serves: one more, on the worker holding a warm
    assert [(u.model, u.worker_id) for u in ups] == [("a", "w2")]
    assert policy.counts["scale_up_warm"] == 1
    assert "load 3.6" in next(d.reason for d in decisions if isinstance(d.action, ScaleUp))
    # in flight: the next interval decides no more, even at a higher load (it counts as capacity)
    assert actions(policy.decide(view(104.0, *workers), Busy(())), ScaleUp) == []


def test_one_decision_one_load_model_until_the_stats_list_the_instance() -> None:
    capacity = ScaleUpPolicy()
    policy = WarmServePolicy(SETTINGS, capacity=capacity)
    core = PlannerCore([policy])
    full = (wv("w0", inst("w0", "a", running=4, waiting=8)), wv("w1"))
    for t in (100.0, 101.0):
        core.step(view(t, *full))
    (effect,) = [e for e in core.step(view(102.0, *full)) if isinstance(e.actions[0], ScaleUp)]
    capacity.tracker.named(effect)
    up = effect.actions[0]
    assert up.worker_id == "w1"
    assert capacity.tracker.plan_of("a") == effect.plan_id  # a capacity request meanwhile gets this plan
    # the LoadModel is answered (applied) before w1's stats list the instance: w1 is not picked again, and the
    # start still counts (load 12 needs ceil(12 / 3.2) = 4 instances: 2 more, on workers that have room)
    core.on_outcome(PlanApplied(plan_id=effect.plan_id, ts=103.0, duration_s=1.0, commands=1))
    later = [e.actions[0] for e in core.step(view(103.5, *full)) if isinstance(e.actions[0], ScaleUp)]
    assert all(a.worker_id != "w1" for a in later)
    # the stats list it: it is an instance now, not a start
    shown = (full[0], WorkerView(worker_id="w1", stats_ts=104.0, pool_capacity_bytes=CAP, instances=(
        InstanceView(instance_id=up.instance_id, model="a", worker_id="w1"),)))
    core.step(view(104.0, *shown))
    assert capacity.tracker.count("a") == 0


def test_an_idle_instance_stops_after_the_protect_period_never_a_busy_one() -> None:
    policy = WarmServePolicy(SETTINGS)
    workers = (wv("w0", inst("w0", "a")), wv("w1", inst("w1", "a", running=1)))
    # load 1 (w1's request) < 0.5 x 8: keep ceil(1 / 0.5 / 4) = 1; w0 is idle but only seen since 100
    assert actions(policy.decide(view(100.0, *workers), Busy(())), ScaleDown) == []
    assert actions(policy.decide(view(104.0, *workers), Busy(())), ScaleDown) == []
    decisions = policy.decide(view(105.5, *workers), Busy(()))
    downs = actions(decisions, ScaleDown)
    assert [(d.worker_id, d.instance_id) for d in downs] == [("w0", "w0-a")]  # the idle one
    worker, cmd = _command(policy, decisions, ScaleDown)
    assert worker == "w0" and isinstance(cmd, EvictModel) and cmd.drain and cmd.instance_id == "w0-a"
    assert cmd.model == "a"


def _command(policy: WarmServePolicy, decisions: list, kind: type):
    """(worker, ctl command) that applies the one decision of `kind`."""
    core = PlannerCore([policy])
    (effect,) = core.submit(policy, [d for d in decisions if isinstance(d.action, kind)], view(100.0))
    ((worker, cmd),) = ctl_commands(effect)
    return worker, cmd


def test_an_idle_model_scales_to_zero_only_when_the_dispatcher_can_scale_from_zero() -> None:
    workers = (wv("w0", inst("w0", "a")),)
    for floor, expect in ((0, ["w0-a"]), (1, [])):
        policy = WarmServePolicy(WarmServeSettings(batch_size=4, min_instances=floor))
        policy.decide(view(100.0, *workers), Busy(()))
        assert [d.instance_id for d in actions(policy.decide(view(106.0, *workers), Busy(())), ScaleDown)] == expect


def test_prewarms_follow_alg1_on_idle_and_universal_workers_only() -> None:
    policy = WarmServePolicy(SETTINGS)
    workers = (wv("w0", inst("w0", "b", running=2)), wv("w1"), wv("w2"), wv("w3", warm={"b": 2000}))
    # a: none active, avg 0 -> no scale-up; peak 8 -> two burst replicas (Eq. 6); b: one serving, peak 12 -> 2 burst
    decisions = policy.decide(view(100.0, *workers, forecasts=(fc("a", 0.0, 8.0), fc("b", 2.0, 12.0))), Busy(()))
    assert actions(decisions, ScaleUp) == []
    placed = sorted((p.worker_id, p.model) for p in actions(decisions, PlacePrewarm))
    assert "w0" not in {w for w, _ in placed}  # serving: not a candidate
    assert len({w for w, _ in placed}) == len(placed)  # one prewarm in flight per worker
    assert ("w3", "b") not in placed  # b is warm there already (it counts as one of b's replicas)
    assert all(p.layers.start == 0 and p.layers.end == 4 for p in actions(decisions, PlacePrewarm))
    assert {m for _, m in placed} <= {"a", "b"} and placed  # something was prewarmed
    assert all(p.cap_instance_id is None for p in actions(decisions, PlacePrewarm))  # no grace worker


def test_a_higher_scored_replica_evicts_a_lower_one_when_memory_is_short() -> None:
    small = WarmServeSettings(batch_size=4, mean_request_s=1.0)
    policy = WarmServePolicy(small)
    # w1's pool has room for one of b (2000 B) beside a's 1000 B only if a goes: make it tight
    tight = WorkerView(worker_id="w1", pool_capacity_bytes=2500, pool_bytes=MappingProxyType(
        {"weights": 0, "prewarm": 1000, "adapter": 0, "kv": 0, "workspace": 0, "free": 1500}),
        prewarmed=MappingProxyType({"a": 1000}))
    decisions = policy.decide(view(100.0, tight, forecasts=(fc("b", 0.0, 40.0),)), Busy(()))
    # a has no forecast: its warm replica ranks lowest and is released for b's burst replica
    assert [(r.worker_id, r.model) for r in actions(decisions, ReleasePrewarm)] == [("w1", "a")]
    assert [(p.worker_id, p.model) for p in actions(decisions, PlacePrewarm)] == [("w1", "b")]


def test_prewarm_false_decides_no_prewarm_but_still_scales() -> None:
    off = WarmServePolicy(WarmServeSettings(prewarm=False, batch_size=4, mean_request_s=1.0))
    workers = (wv("w0"), wv("w1"))
    forecasts = (fc("a", 2.0, 30.0), fc("b", 0.0, 30.0))
    off.decide(view(100.0, *workers, forecasts=forecasts, queued=10), Busy(()))
    decisions = off.decide(view(101.0, *workers, forecasts=forecasts, queued=10), Busy(()))
    assert actions(decisions, PlacePrewarm) == [] and actions(decisions, ReleasePrewarm) == []
    assert [u.model for u in actions(decisions, ScaleUp)] == ["a"]  # 10 queued, no instance: any load starts one


def test_proactive_prewarm_on_a_grace_worker_caps_its_kv_at_the_eq1_target() -> None:
    policy = WarmServePolicy(SETTINGS)
    draining = inst("w0", "b", running=1, accepting=False, kv_used_blocks=10)  # K = 1000 B
    grace = wv("w0", draining, kv=3000)
    decisions = policy.decide(view(100.0, grace, forecasts=(fc("a", 0.0, 4.0),)), Busy(()))
    (pre,) = actions(decisions, PlacePrewarm)
    m = CAP - B.weight_bytes  # M: the pool less the instance's weights (KV and prewarms share it)
    target = reservation_target(m, 4, 1, 1000)  # max(8000 x 1/4, 1000 + 8000/4) = 3000
    assert target == 3000 and pre.worker_id == "w0" and pre.model == "a"
    assert pre.cap_instance_id == "w0-b" and pre.kv_cap_bytes == 3000
    worker, cmd = _command(policy, decisions, PlacePrewarm)
    assert isinstance(cmd, Prewarm) and cmd.cap_instance_id == "w0-b" and cmd.kv_cap_bytes == 3000 and worker == "w0"
    # a larger running batch raises the target past the room: nothing fits, nothing is placed
    busy = wv("w0", inst("w0", "b", running=4, accepting=False, kv_used_blocks=70), kv=7500)
    assert actions(WarmServePolicy(SETTINGS).decide(view(100.0, busy, forecasts=(fc("a", 0.0, 4.0),)), Busy(())),
                   PlacePrewarm) == []


@pytest.mark.parametrize("worker, label", [
    (wv("w"), "idle"), (wv("w", warm={"a": 1000}), "universal"), (wv("w", inst("w", "a")), "dedicated"),
    (wv("w", inst("w", "a", accepting=False), warm={"b": 5}), "grace"),
])
def test_lifecycle_labels(worker: WorkerView, label: str) -> None:
    assert lifecycle_label(lifecycle_of(worker)) == label


def test_bad_settings_are_refused_naming_them() -> None:
    with pytest.raises(ValueError, match="prewarm_fraction"):
        WarmServeSettings(prewarm_fraction=0.0)


def test_never_scales_down_while_requests_run_or_wait() -> None:
    policy = WarmServePolicy(SETTINGS)
    busy_both = (wv("w0", inst("w0", "a", running=1)), wv("w1", inst("w1", "a", waiting=2)))
    for t in range(100, 140):  # both carry requests all along: neither is stopped, however low the load
        assert actions(policy.decide(view(float(t), *busy_both), Busy(())), ScaleDown) == []
    one_idle = (wv("w0", inst("w0", "a")), wv("w1", inst("w1", "a", running=1)))
    queued = WarmServePolicy(SETTINGS)
    for t in range(100, 140):  # the dispatchers hold requests of the model: no instance of it stops
        assert actions(queued.decide(view(float(t), *one_idle, queued=1), Busy(())), ScaleDown) == []
    downs = actions(queued.decide(view(140.0, *one_idle), Busy(())), ScaleDown)
    assert [d.instance_id for d in downs] == ["w0-a"]  # once the queue is gone: the idle one only


def test_the_autoscaler_passes_over_a_warm_worker_busy_with_another_hot_model_when_a_cold_start_is_cheaper() -> None:
    # B's instance on w2 runs 3 requests where a is warm: 3 x (1 s request + 5 s window) = 18 s of sharing; a cold
    # start of a (1000 B) at the setting's 2 GB/s is ~0: the idle cold w1. At 10 B/s (100 s) the warm w2 wins.
    def scale_up_target(load_bytes_per_s: float) -> str:
        policy = WarmServePolicy(WarmServeSettings(batch_size=4, mean_request_s=1.0, load_bytes_per_s=load_bytes_per_s))
        workers = (wv("w0", inst("w0", "a", running=4, waiting=2)), wv("w1"),
                   wv("w2", inst("w2", "b", running=2, waiting=1), warm={"a": 1000}))
        for t in (100.0, 101.0, 102.0):
            policy.decide(view(t, *workers), Busy(()))
        (up,) = actions(policy.decide(view(103.0, *workers), Busy(())), ScaleUp)
        return up.worker_id

    assert scale_up_target(2e9) == "w1"
    assert scale_up_target(10.0) == "w2"
