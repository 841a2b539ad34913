"""KunServe's drop plan (§4.1 Alg. 1, §4.3): the paper's worked arithmetic, the greedy variants,
infeasible demand, batch limits, and the planner actions it becomes."""
from __future__ import annotations

import pytest

from shared.events.common import LayerRange
from shared.events.plan import DropInstanceLayers, FormGroup
from shared.events.registry import ModelRecord
from shared.events.worker import InstanceStats
from shared.policy.kunserve import plan_actions, plan_drop
from shared.policy.kunserve_groups import alg1_sizes, memory_greedy_sizes, throughput_greedy_sizes
from shared.policy.kunserve_load import InstanceLoad, from_instance_stats, total_deficit
from shared.policy.kunserve_profile import PipelineProfile, StageOverhead
from shared.profiles import load_pipeline_profile

GB = 10**9
LAYERS = 48  # Qwen-2.5-14B
LAYER_BYTES = 28 * GB // LAYERS  # Table 1: 28 GB of parameters on an 80 GB A800
P = LAYERS * LAYER_BYTES
PROFILE = load_pipeline_profile()


def fleet(n: int = 8, *, kv_capacity: int = 46 * GB, used: int = 40 * GB, queued: int = 0,
          growth: float = 0.0) -> list[InstanceLoad]:
    return [InstanceLoad(instance_id=f"i{j}", worker_id=f"w{j}", model="qwen2.5-14b", num_layers=LAYERS,
                         layer_bytes=LAYER_BYTES, kv_capacity_bytes=kv_capacity, kv_used_bytes=used,
                         queued_kv_bytes=queued, kv_growth_bytes_per_s=growth) for j in range(n)]


def test_eight_instances_four_groups_free_four_replicas() -> None:
    # §4.1: "a cluster with 8 instances. If we divide them into 4 groups, then the freed memory is 4x
    # the parameter size." Each instance lacks P/2 one second ahead: R = 4P.
    loads = fleet(queued=P // 2 + 6 * GB)
    assert total_deficit(loads) == 4 * P
    plan = plan_drop(loads, PROFILE)
    assert plan.group_sizes == [2, 2, 2, 2] and len(plan.groups) == 4 and plan.unsplit == []
    assert plan.freed_bytes == 4 * P and plan.feasible and plan.shortfall_bytes == 0
    for group in plan.groups:  # Fig. 3(d): one keeps the first half, its buddy the second half
        assert [m.member.layers for m in group.members] == [LayerRange(start=0, end=24), LayerRange(start=24, end=48)]
        assert [m.dropped for m in group.members] == [[LayerRange(start=24, end=48)], [LayerRange(start=0, end=24)]]
        assert [m.freed_bytes for m in group.members] == [P // 2, P // 2]
    # modeled throughput: 4 two-stage groups at the published 17.2% loss; Cost = 1 / 0.828
    assert plan.throughput == pytest.approx(8 * 0.828)
    assert plan.cost == pytest.approx(1 / 0.828)


def test_one_group_of_eight_frees_only_one_point_seven_five_times_more() -> None:
    # §4.1: "grouping all 8 instances into one group, the overall free memory only increases by
    # 1.75x (7x more memory)" -- and the memory-greedy variant does just that.
    four = plan_drop(fleet(), PROFILE, required_bytes=4 * P)
    one = plan_drop(fleet(), PROFILE, required_bytes=4 * P, strategy="memory_greedy")
    assert one.group_sizes == [8]
    assert one.freed_bytes == 7 * P and one.freed_bytes / four.freed_bytes == pytest.approx(1.75)
    assert one.groups[0].members[0].member.layers == LayerRange(start=0, end=6)


def test_throughput_greedy_and_memory_greedy_differ_and_the_default_keeps_throughput() -> None:
    # Fig. 16: memory-greedy provides more KV memory but more pipeline overhead.
    tg = plan_drop(fleet(), PROFILE, required_bytes=2 * P)
    mg = plan_drop(fleet(), PROFILE, required_bytes=2 * P, strategy="memory_greedy")
    assert tg.group_sizes == [2, 2, 1, 1, 1, 1] and tg.freed_bytes == 2 * P
    assert mg.group_sizes == [8]  # grows until the freed memory exceeds the 8 x 46 GB KV region (it cannot)
    assert mg.freed_bytes > tg.freed_bytes and mg.throughput < tg.throughput
    assert tg.throughput == pytest.approx(2 * 2 * 0.828 + 4)
    assert plan_drop(fleet(), PROFILE, required_bytes=2 * P, strategy="optimal").group_sizes == tg.group_sizes
    # memory-greedy stops once the freed memory exceeds the original KV region
    assert memory_greedy_sizes(8, P, 2 * P, 8, kv_region=3 * P) == [4, 1, 1, 1, 1]


def test_variants_agree_when_only_the_deepest_pipeline_is_enough() -> None:
    tg = plan_drop(fleet(), PROFILE, required_bytes=7 * P)
    mg = plan_drop(fleet(), PROFILE, required_bytes=7 * P, strategy="memory_greedy")
    assert tg.group_sizes == mg.group_sizes == [8] and tg.feasible


def test_alg1_merges_the_two_smallest_groups() -> None:
    assert alg1_sizes(8, P, 0, 8) == [1] * 8
    assert alg1_sizes(8, P, 1, 8) == [2, 1, 1, 1, 1, 1, 1]
    assert alg1_sizes(8, P, 5 * P, 8) == [4, 2, 2]  # the fifth merge pairs two pairs
    assert alg1_sizes(7, P, 6 * P, 4) == [4, 3]  # 7 into groups of at most 4: the last merge would make 7
    assert alg1_sizes(5, P, 4 * P, 2) == [2, 2, 1]


def test_the_highest_modeled_throughput_wins_over_alg1_when_the_profile_is_not_concave() -> None:
    # k x efficiency(k) = 1, 1, 1.5, 2: one deep group beats two pairs here, at the same freed memory
    odd = PipelineProfile(name="odd", stages=[StageOverhead(stages=k, throughput_efficiency=e, source="test")
                                              for k, e in [(1, 1.0), (2, 0.5), (3, 0.5), (4, 0.5)]])
    assert alg1_sizes(4, P, 2 * P, 4) == [2, 2]
    assert throughput_greedy_sizes(4, P, 2 * P, 4, odd) == [3, 1]
    plan = plan_drop(fleet(4), odd, required_bytes=2 * P)
    assert plan.group_sizes == [3, 1] and plan.throughput == pytest.approx(2.5) and plan.freed_bytes == 2 * P


def test_infeasible_demand_frees_the_most_it_can_and_says_so() -> None:
    plan = plan_drop(fleet(), PROFILE, required_bytes=10 * P)
    assert plan.group_sizes == [8] and plan.freed_bytes == 7 * P
    assert not plan.feasible and plan.shortfall_bytes == 3 * P and "short" in plan.reason
    # 16 instances, pipelines of at most 8 stages (the profile's deepest): two groups of 8
    big = plan_drop(fleet(16), PROFILE, required_bytes=20 * P)
    assert big.group_sizes == [8, 8] and big.freed_bytes == 14 * P and big.shortfall_bytes == 6 * P
    # a 3-layer model cannot be split in more than 3 stages: 5 instances at most free 3 replicas
    tiny = [InstanceLoad(instance_id=f"t{j}", worker_id=f"w{j}", model="tiny", num_layers=3, layer_bytes=10,
                         kv_capacity_bytes=100) for j in range(5)]
    plan = plan_drop(tiny, PROFILE, required_bytes=1000)
    assert plan.group_sizes == [3, 2] and plan.freed_bytes == 90 and plan.shortfall_bytes == 910


def test_no_demand_forms_no_group() -> None:
    plan = plan_drop(fleet(used=10 * GB), PROFILE)
    assert plan.demand_bytes == 0 and plan.groups == [] and plan.feasible and plan_actions(plan) == []
    assert plan.throughput == 8 and plan.cost == 1.0


def test_the_hot_instances_group_and_pair_with_cooler_ones() -> None:
    loads = fleet(4)
    loads[2] = InstanceLoad(**{**_fields(loads[2]), "queued_kv_bytes": 30 * GB})  # hottest
    loads[0] = InstanceLoad(**{**_fields(loads[0]), "queued_kv_bytes": 20 * GB})
    loads[3] = InstanceLoad(**{**_fields(loads[3]), "kv_used_bytes": 5 * GB})  # coolest
    plan = plan_drop(loads, PROFILE, required_bytes=P)
    assert plan.group_sizes == [2, 1, 1] and plan.unsplit == ["i1", "i3"]
    assert [m.instance_id for m in plan.groups[0].members] == ["i0", "i2"]
    plan = plan_drop(loads, PROFILE, required_bytes=2 * P)
    assert sorted(sorted(m.instance_id for m in g.members) for g in plan.groups) == [["i0", "i1"], ["i2", "i3"]]


def test_layer_shares_follow_member_memory() -> None:
    loads = fleet(2)
    loads[1] = InstanceLoad(**{**_fields(loads[1]), "kv_capacity_bytes": 2 * 46 * GB + P})  # twice the budget
    plan = plan_drop(loads, PROFILE, required_bytes=1)
    kept = [m.member.layers for m in plan.groups[0].members]
    assert kept == [LayerRange(start=0, end=16), LayerRange(start=16, end=48)]
    assert plan.groups[0].freed_bytes == P


def test_max_batch_after_dropping() -> None:
    # §4.3: each member admits its share of the group's compute: 64 x 0.828 -> 52 for a pair
    plan = plan_drop(fleet(), PROFILE, required_bytes=4 * P, unsplit_max_batch=64)
    assert {m.max_batch for g in plan.groups for m in g.members} == {52}
    assert plan.groups[0].max_batch == 104
    deep = plan_drop(fleet(), PROFILE, required_bytes=7 * P, unsplit_max_batch=64)
    assert deep.groups[0].members[0].max_batch == int(8 * 64 * 0.4075) // 8


def test_plan_actions_form_the_groups_then_drop() -> None:
    plan = plan_drop(fleet(4), PROFILE, required_bytes=P, group_id_prefix="bg-p1-3")
    actions = plan_actions(plan)
    assert isinstance(actions[0], FormGroup) and actions[0].group_id == "bg-p1-3-0"
    assert actions[0].members == [m.member for m in plan.groups[0].members]
    drops = actions[1:]
    assert all(isinstance(a, DropInstanceLayers) and a.group_id == "bg-p1-3-0" for a in drops)
    assert sorted((a.instance_id, a.layers.start, a.layers.end) for a in drops) == [
        (plan.groups[0].members[0].instance_id, 24, 48), (plan.groups[0].members[1].instance_id, 0, 24)]


def test_instances_already_grouped_are_not_planned_again() -> None:
    loads = fleet(4, queued=20 * GB)
    loads[0] = InstanceLoad(**{**_fields(loads[0]), "group_id": "bg-0", "kept_layers": (0, 24)})
    plan = plan_drop(loads, PROFILE)
    assert plan.already_grouped == ["i0"]
    assert "i0" not in {m.instance_id for g in plan.groups for m in g.members} | set(plan.unsplit)


def test_bad_input_is_named() -> None:
    with pytest.raises(ValueError, match="at least one instance"):
        plan_drop([], PROFILE)
    mixed = fleet(2) + [InstanceLoad(instance_id="x", worker_id="w9", model="other", num_layers=LAYERS,
                                     layer_bytes=LAYER_BYTES, kv_capacity_bytes=1)]
    with pytest.raises(ValueError, match="per model"):
        plan_drop(mixed, PROFILE)
    with pytest.raises(ValueError, match="unique"):
        plan_drop(fleet(2) + fleet(1), PROFILE)
    with pytest.raises(ValueError, match="strategy"):
        plan_drop(fleet(2), PROFILE, strategy="random")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="group_id_prefix"):
        plan_drop(fleet(2), PROFILE, group_id_prefix="bad.prefix")
    with pytest.raises(ValueError, match="layer_bytes"):
        InstanceLoad(instance_id="x", worker_id="w", model="m", num_layers=4, layer_bytes=0, kv_capacity_bytes=1)


def test_loads_from_worker_stats_and_the_catalog() -> None:
    record = ModelRecord(name="qwen2.5-14b", path="/m", num_layers=LAYERS, max_context=32768,
                         layer_bytes=LAYER_BYTES)
    stats = InstanceStats(instance_id="i0", model="qwen2.5-14b", layers=LayerRange(start=0, end=LAYERS),
                          kv_blocks_total=1000, kv_blocks_used=900, kv_block_bytes=16 * 196_608,
                          queued_prompt_tokens=4096, kv_growth_blocks_per_s=50.0)
    load = from_instance_stats(stats, worker_id="w0", model=record, kv_block_tokens=16)
    assert load.kv_capacity_bytes == 1000 * 16 * 196_608 and load.kv_used_bytes == 900 * 16 * 196_608
    assert load.queued_kv_bytes == 4096 * 196_608  # §2.2: 192 KB per token for Qwen-2.5-14B
    assert load.projected_demand(1.0) == (900 + 50) * 16 * 196_608 + 4096 * 196_608
    assert load.kept_layers is None and not load.grouped
    split = from_instance_stats(
        InstanceStats(instance_id="i1", model="qwen2.5-14b", layers=LayerRange(start=24, end=48), group_id="bg-0"),
        worker_id="w1", model=record, kv_block_tokens=16)
    assert split.dropped_bytes == 24 * LAYER_BYTES and split.grouped
    with pytest.raises(ValueError, match="layer_bytes"):
        from_instance_stats(stats, worker_id="w0", model=ModelRecord(name="qwen2.5-14b", path="/m", num_layers=48,
                                                                     max_context=1), kv_block_tokens=16)


def _fields(load: InstanceLoad) -> dict:
    return {name: getattr(load, name) for name in load.__slots__}
