"""KunServe's drop in the buddy-group simulator lands while the burst lasts: each member drops at its
own step boundary, the plan's deficit counts memory-blocked demand only, a group's overflow goes back
to the dispatcher (§4.3), and groups stop at the 2 stages the published efficiencies cover."""
from __future__ import annotations

import pytest

from loadgen.repro.kunserve import (
    HIDDEN_BYTES, LAYER_BYTES, NUM_LAYERS, SCALES, STAGE_OVERHEAD_S, harness_profile, pipeline_profile,
)
from loadgen.sim.buddy_cluster import BuddyCluster, ClusterConfig
from loadgen.sim.pipeline import PipelineCost
from loadgen.sim.request import SimRequest
from loadgen.traces.schema import BurstGPTParams, Trace, TraceHeader
from shared.policy.kunserve import plan_drop

CFG = SCALES["paper"]


def cluster(instances: int) -> BuddyCluster:
    empty = Trace(header=TraceHeader(params=BurstGPTParams(), num_records=0, duration_s=1.0), records=[])
    pipe = PipelineCost(stage_overhead_s=STAGE_OVERHEAD_S, activation_bytes=HIDDEN_BYTES * 256, num_layers=NUM_LAYERS)
    return BuddyCluster(empty, harness_profile(CFG), pipeline_profile(CFG), pipe,
                        ClusterConfig(system="kunserve", instances=instances), NUM_LAYERS, LAYER_BYTES)


def test_a_member_in_a_long_prefill_does_not_hold_its_partner():
    c = cluster(2)
    e0 = c.engines[0]
    req = SimRequest(0, "r0", "model", None, 0.0, 20000, 10)
    end = e0.worker.enqueue(req, 0.0)  # a 20k-token prefill: ~3.8 s on its own GPU
    assert end is not None and end > 3.0
    c._at(end, 0, (e0.worker.index, e0.worker.gen))
    landed: list[tuple[int, float]] = []
    land = c._land
    c._land = lambda g, m, moved, ex, t: (landed.append((m, t)), land(g, m, moved, ex, t))  # type: ignore[method-assign]
    c._merge([0, 1], 0.1)
    group = next(e for e in c.engines.values() if len(e.members) == 2)
    assert landed == [(1, 0.1)]  # the idle member dropped at once and formed the group
    assert group.joined == [1] and group.worker.total == c._share_blocks(2) and c.drops == 1
    assert e0.draining and 0 in c.engines  # the busy one finishes its step first
    c.run()
    assert landed[1][0] == 0 and landed[1][1] == pytest.approx(end)  # ... and joins at its own boundary
    assert req.first_token == pytest.approx(end) and req.generated == 10 and req.finish > end


def test_the_plan_counts_queued_prompts_only_where_memory_blocks_them():
    c = cluster(2)
    w = c.engines[0].worker
    w.queued_tokens = 50_000
    w.blocked_on = "compute"  # a compute backlog with KV to spare
    assert c._loads()[0].queued_kv_bytes == 0
    w.blocked_on = "memory"
    assert c._loads()[0].queued_kv_bytes == 50_000 * 196_608


def test_a_groups_overflow_goes_back_to_the_dispatcher_newest_first():
    c = cluster(3)
    c._merge([0, 1], 0.0)  # both idle: the group forms at once
    group = next(e for e in c.engines.values() if len(e.members) == 2)
    assert group.joined is None
    w = group.worker
    extra = 5
    reqs = [SimRequest(i, f"r{i}", "model", None, 0.0, 64, 4) for i in range(w.spec.max_batch + extra)]
    for r in reqs:  # queued without a step: the group's batch can take max_batch of them
        w.waiting.append(r)
        w.queued_tokens += r.to_prefill
    c._rebalance(0.0)
    assert c.overflowed == extra and len(w.waiting) == w.spec.max_batch
    spare = c.engines[next(i for i, e in c.engines.items() if e.members == [2])].worker
    assert {r.order for r in reqs[-extra:]} == {r.order for r in [*spare.waiting, *spare.prefilling]}


def test_groups_stop_at_two_stages_however_large_the_deficit():
    from shared.policy.kunserve_load import InstanceLoad

    kv = 33_000_000_000
    loads = [InstanceLoad(instance_id=f"i{i}", worker_id=f"w{i}", model="m", num_layers=NUM_LAYERS,
                          layer_bytes=LAYER_BYTES, kv_capacity_bytes=kv, kv_used_bytes=kv, queued_kv_bytes=10 * kv)
             for i in range(8)]
    plan = plan_drop(loads, pipeline_profile(CFG))
    assert max(plan.group_sizes) == 2 and len(plan.groups) == 4 and not plan.feasible


def test_overflow_never_sends_a_target_past_its_batch_room():
    import msgspec

    from loadgen.sim.pipeline import overflow
    from loadgen.sim.worker import SimWorker

    profile = harness_profile(CFG)
    small = msgspec.structs.replace(profile.worker, max_batch=3)
    group, spare = (SimWorker(i, f"w{i}", "model", small, profile.step, 0.5) for i in range(2))
    reqs = [SimRequest(i, f"r{i}", "model", None, 0.0, 64, 4) for i in range(8)]
    for r in reqs:
        group.waiting.append(r)
        group.queued_tokens += r.to_prefill
    moves = overflow(group, [spare])
    assert [r.order for r, _ in moves] == [7, 6, 5]  # newest first, only as many as the spare can batch
    assert len(group.waiting) == 5 and group.queued_tokens == 5 * 64
