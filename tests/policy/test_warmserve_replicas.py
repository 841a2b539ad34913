"""WarmServe Eqs. 1 and 5-8 on worked numbers, and the worker lifecycle."""
from __future__ import annotations

import math

import pytest

from shared.policy.warmserve import (
    LifecycleError, ModelDemand, WorkerLife, WorkerRole, burstiness, by_priority, concurrent_load, prewarm_replicas,
    prewarm_room, replica_counts, reservation_target,
)


def demand(model="m", *, batch=32, active=1, avg=70.0, peak=150.0, cold=10.0, size=100, parallel=1) -> ModelDemand:
    return ModelDemand(model=model, size_bytes=size, parallel=parallel, batch_size=batch, active=active,
                       avg_load=avg, peak_load=peak, cold_start_s=cold)


def test_replica_counts_eqs_5_and_6():
    # N_basic = max(ceil(70/32) - 1, 0) = 2; N_burst = max(ceil(150/32) - 2 - 1, 0) = 2
    assert replica_counts(demand()) == (2, 2)
    assert replica_counts(demand(active=4)) == (0, 1)  # 4 instances cover the average; 5 the peak
    assert replica_counts(demand(active=6)) == (0, 0)
    assert replica_counts(demand(avg=0.0, peak=0.0, active=0)) == (0, 0)  # scale to zero: nothing to prewarm


def test_prewarming_scores_eqs_7_and_8():
    basic0, basic1, burst0, burst1 = prewarm_replicas(demand())
    assert (basic0.kind, basic0.rank, basic0.score) == ("basic", 0, pytest.approx(10.0))  # e^0 T_c
    assert basic1.score == pytest.approx(math.exp(-1 / 4) * 10)  # 7.788
    factor = (150 - 70) / 70
    assert burst0.score == pytest.approx(math.exp(-2 / 4) * 10 * factor)  # 6.932
    assert burst1.score == pytest.approx(math.exp(-3 / 4) * 10 * factor)  # 5.398
    assert (burst0.kind, burst1.rank) == ("burst", 1)


def test_every_basic_replica_ranks_above_every_burst_replica():
    spiky = prewarm_replicas(demand("spiky", active=1, avg=10.0, peak=320.0, cold=30.0))  # burst scores ~ 200
    calm = prewarm_replicas(demand("calm", active=0, avg=40.0, peak=40.0, cold=1.0))  # basic scores ~ 1
    order = by_priority(spiky + calm)
    assert [r.kind for r in order] == ["basic"] * 2 + ["burst"] * 9
    assert order[0].model == "calm" and order[0].score == pytest.approx(1.0)
    assert max(r.score for r in spiky if r.kind == "burst") > 100


def test_burstiness_counts_an_average_under_one_request_as_one():
    assert burstiness(demand(avg=0.0, peak=3.0)) == 3.0
    assert burstiness(demand(avg=2.0, peak=3.0)) == 0.5
    assert concurrent_load(4.0, 2.5) == 10.0


def test_reservation_target_eq_1():
    # M = 1000 KV blocks, C = 32: expected use of 8 requests is 250; actual 300 + one request's 31.25
    assert reservation_target(1000, 32, 8, 300) == pytest.approx(331.25)
    assert reservation_target(1000, 32, 16, 100) == pytest.approx(500.0)  # the expected use dominates
    assert prewarm_room(1000, 32, 8, 300, kv_reserved=1000) == pytest.approx(668.75)
    assert prewarm_room(1000, 32, 16, 100, kv_reserved=400) == 0.0  # keeps all it has, gives nothing
    with pytest.raises(ValueError, match="max_batch >= 1"):
        reservation_target(1000, 0, 1, 0)


def test_bad_demand_is_refused_by_name():
    with pytest.raises(ValueError, match="m: need size_bytes"):
        demand(batch=0)
    with pytest.raises(ValueError, match="not NaN"):
        demand(avg=float("nan"))


def test_lifecycle_idle_universal_dedicated_and_back():
    w = WorkerLife.idle("g0").prewarm("a").prewarm("b")
    assert w.role is WorkerRole.UNIVERSAL and w.prewarmed == {"a", "b"}
    served, hit, evicted = w.dedicate("a")
    assert (served.role, served.serving, hit, evicted) == (WorkerRole.DEDICATED, "a", True, {"b"})
    cold, hit, evicted = WorkerLife.idle("g1").dedicate("c")
    assert not hit and evicted == frozenset()
    with pytest.raises(LifecycleError, match="g0: cannot prewarm 'c' while dedicated\\(a\\)"):
        served.prewarm("c")
    stopping = served.begin_grace().prewarm("c")  # proactive prewarming into the KV surplus
    assert stopping.role is WorkerRole.DEDICATED and stopping.prewarmed == {"c"}
    back = stopping.release()
    assert back.role is WorkerRole.UNIVERSAL and back.prewarmed == {"a", "c"}  # served model kept warm
    resumed, dropped = served.begin_grace().prewarm("c").cancel_grace()
    assert resumed.prewarmed == frozenset() and dropped == {"c"} and not resumed.grace
    assert WorkerLife.idle("g2").prewarm("a").evict("a").role is WorkerRole.IDLE
    with pytest.raises(LifecycleError, match="already serves"):
        served.dedicate("b")
    with pytest.raises(LifecycleError, match="not prewarmed"):
        back.evict("zz")
    with pytest.raises(LifecycleError, match="idle worker holds no weights"):
        WorkerLife("g3", WorkerRole.IDLE, prewarmed=frozenset({"a"}))
