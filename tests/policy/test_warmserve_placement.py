"""WarmServe's evict-aware placement (Alg. 1): worked cases and properties (hypothesis)."""
from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from shared.policy.warmserve import (
    Gpu, ModelDemand, PlacedReplica, PrewarmReplica, WorkerRole, place, scale_up_target,
)
from shared.policy.warmserve_placement import partially_overlaps


def demand(model: str, *, parallel: int = 1, size: int = 60, cold: float = 10.0, avg: float = 32.0,
           peak: float = 32.0, active: int = 0) -> ModelDemand:
    return ModelDemand(model=model, size_bytes=size, parallel=parallel, batch_size=32, active=active,
                       avg_load=avg, peak_load=peak, cold_start_s=cold)


def gpus(n: int, free: int = 100, server: str = "s0") -> list[Gpu]:
    return [Gpu(worker=f"{server}g{i}", server=server, free_bytes=free) for i in range(n)]


def test_high_priority_replicas_are_isolated_and_groups_never_partially_overlap():
    plan = place([demand("hi", parallel=2, cold=20.0), demand("lo", parallel=2, cold=5.0),
                  demand("tiny", parallel=1, size=10, cold=1.0)], gpus(4))
    where = {p.model: sorted(p.workers) for p in plan.placed}
    assert where["hi"] == ["s0g0", "s0g1"]
    assert where["lo"] == ["s0g2", "s0g3"]  # not nested under hi: it would rank below it there
    assert len(where["tiny"]) == 1  # nested under one of them (both outrank it): the lesser sum, lo's
    assert where["tiny"][0] in where["lo"]
    assert not plan.evicted and not plan.skipped


def test_lower_scored_replicas_are_evicted_for_a_higher_one():
    lo = PlacedReplica(PrewarmReplica("lo", "burst", 0, 1.0), frozenset({"s0g0", "s0g1"}), 40)
    free = gpus(2, free=50)  # 40 more are lo's
    plan = place([demand("hi", parallel=2, size=160, cold=9.0)], free, [lo])
    assert [sorted(p.workers) for p in plan.placed] == [["s0g0", "s0g1"]]
    assert plan.evicted == (lo,)
    # a replica ranking below the one already there evicts nothing and is skipped
    hi = PlacedReplica(PrewarmReplica("hi", "basic", 0, 9.0), frozenset({"s0g0", "s0g1"}), 40)
    plan = place([demand("lo", parallel=2, size=160, cold=1.0)], free, [hi])
    assert not plan.placed and not plan.evicted and [r.model for r in plan.skipped] == ["lo"]


def test_groups_stay_within_one_server_and_only_candidates_are_used():
    fleet = gpus(1, server="a") + gpus(1, server="b")
    assert place([demand("m", parallel=2)], fleet).skipped  # two GPUs, but on two servers
    fleet = [Gpu("d0", "s", 100, WorkerRole.DEDICATED, serving="x"),
             Gpu("d1", "s", 100, WorkerRole.DEDICATED, grace=True, serving="x"),
             Gpu("d2", "s", 100, WorkerRole.DEDICATED, grace=True, serving="m")]
    plan = place([demand("m")], fleet)
    assert [sorted(p.workers) for p in plan.placed] == [["d1"]]  # proactive: the grace period of x


def test_replicas_of_one_model_go_to_disjoint_gpus():
    plan = place([demand("m", avg=96.0)], gpus(4))  # three basic replicas
    groups = [p.workers for p in plan.placed]
    assert len(groups) == 3 and len(frozenset().union(*groups)) == 3


def test_scale_up_dedicates_the_replica_that_evicts_least():
    def rep(model: str, score: float, *workers: str) -> PlacedReplica:
        return PlacedReplica(PrewarmReplica(model, "basic", 0, score), frozenset(workers), 10)

    x0, x1, y, z = rep("x", 3, "g0"), rep("x", 2, "g1"), rep("y", 5, "g0"), rep("z", 1, "g1")
    pick = scale_up_target("x", [x0, x1, y, z])
    assert pick is not None and pick.replica is x1 and pick.evicted == (z,)
    assert scale_up_target("none", [x0]) is None


@st.composite
def clusters(draw):
    servers = draw(st.integers(1, 2))
    fleet = []
    for s in range(servers):
        for i in range(draw(st.integers(1, 5))):
            role = draw(st.sampled_from([WorkerRole.IDLE, WorkerRole.UNIVERSAL, WorkerRole.DEDICATED]))
            grace = role is WorkerRole.DEDICATED and draw(st.booleans())
            fleet.append(Gpu(f"s{s}g{i}", f"s{s}", draw(st.integers(0, 200)), role, grace,
                             "busy" if role is WorkerRole.DEDICATED else None))

    def demands(prefix: str):
        return [demand(f"{prefix}{k}", parallel=draw(st.integers(1, 3)), size=draw(st.integers(1, 300)),
                       cold=draw(st.floats(0.1, 50)), avg=draw(st.floats(0, 120)), peak=draw(st.floats(0, 200)),
                       active=draw(st.integers(0, 2))) for k in range(draw(st.integers(1, 4)))]
    return fleet, demands("a"), demands("b")


@settings(max_examples=150, deadline=None)
@given(clusters())
def test_placement_never_partially_overlaps_and_never_exceeds_memory(case):
    fleet, first, second = case
    existing = list(place(first, fleet).placed)
    used0 = {g.worker: sum(r.bytes_per_worker for r in existing if g.worker in r.workers) for g in fleet}
    plan = place(second, fleet, existing)
    final = [r for r in existing if r not in plan.evicted] + list(plan.placed)
    by = {g.worker: g for g in fleet}
    for i, a in enumerate(final):
        for b in final[i + 1:]:
            assert not partially_overlaps(a.workers, b.workers), (a, b)
            assert a.model != b.model or not (a.workers & b.workers)
    for g in fleet:
        use = sum(r.bytes_per_worker for r in final if g.worker in r.workers)
        assert use <= g.free_bytes + used0[g.worker]  # never more than it had free (its replicas' bytes included)
    for p in plan.placed:
        assert len({by[w].server for w in p.workers}) == 1 and all(by[w].candidate for w in p.workers)
    for v in plan.evicted:
        assert any(v.replica.priority < p.replica.priority and v.workers & p.workers for p in plan.placed)
