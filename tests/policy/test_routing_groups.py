"""A buddy group as one routable unit: the entry's ids, pooled KV and load, §4.3's batch limit;
incomplete groups take nothing; unsplit instances pass through unchanged."""
from __future__ import annotations

from shared.policy.admission import has_room
from shared.policy.kunserve_groups import group_max_batch
from shared.policy.routing import InstanceView, LeastOutstandingWork, RequestView
from shared.policy.routing_groups import collapse_groups, profiled_batch, summed_batch
from shared.profiles import load_pipeline_profile


def member(iid: str, worker: str, layers: tuple[int, int] | None, *, group: str | None = "g", used: int = 10,
           total: int = 100, running: int = 0, waiting: int = 0, adapters: frozenset[str] | None = None) -> InstanceView:
    return InstanceView(instance_id=iid, worker_id=worker, model="m", kv_blocks_used=used, kv_blocks_total=total,
                        running_requests=running, waiting_requests=waiting, max_batch=64, group_id=group,
                        layers=layers, adapters=adapters, queued_prompt_tokens=5)


def request(prompt: int = 16) -> RequestView:
    return RequestView(request_id="r", model="m", prompt_tokens=prompt, max_tokens=8)


def test_a_group_is_its_entry_with_pooled_kv_load_and_the_profiled_batch_limit() -> None:
    profile = load_pipeline_profile()
    lone = member("i2", "w2", (0, 8), group=None)
    units = collapse_groups([member("i1", "w1", (4, 8), running=30, waiting=5),
                             member("i0", "w0", (0, 4), running=40, adapters=frozenset({"a", "b"})), lone],
                            profiled_batch(profile))
    assert [(u.instance_id, u.worker_id) for u in units] == [("i0", "w0"), ("i2", "w2")]  # the entry receives
    group = units[0]
    assert (group.kv_blocks_total, group.kv_blocks_used, group.queued_prompt_tokens) == (200, 20, 10)
    assert (group.running_requests, group.waiting_requests, group.layers) == (70, 5, (0, 8))
    assert group.max_batch == group_max_batch(2, 64, profile) == 105  # not 2 x 64
    assert group.adapters == frozenset({"a", "b"})  # known on the entry only: what is known
    assert units[1] is lone


def test_members_over_the_group_limit_overflow_new_requests_to_spare_instances() -> None:
    batch = profiled_batch(load_pipeline_profile())
    full = [member("i0", "w0", (0, 4), running=60), member("i1", "w1", (4, 8), running=50)]  # 110 > 105
    spare = member("i2", "w2", (0, 8), group=None, used=90)
    units = collapse_groups([*full, spare], batch)
    assert not has_room(request(), units[0])
    assert LeastOutstandingWork().choose(request(), [u for u in units if has_room(request(), u)], 0.0) == "i2"
    # below its limit, the group's pooled KV makes it the least loaded unit
    calmer = collapse_groups([member("i0", "w0", (0, 4), running=20), member("i1", "w1", (4, 8)), spare], batch)
    assert LeastOutstandingWork().choose(request(), calmer, 0.0) == "i0"


def test_a_group_missing_a_stage_takes_nothing() -> None:
    assert collapse_groups([member("i1", "w1", (4, 8))]) == []  # the entry is gone
    gap = [member("i0", "w0", (0, 3)), member("i2", "w2", (5, 8))]
    assert collapse_groups(gap) == []
    assert collapse_groups([member("i0", "w0", None), member("i1", "w1", (4, 8))]) == []


def test_three_stages_pool_in_layer_order_and_without_a_profile_sum_the_limits() -> None:
    units = collapse_groups([member("c", "w2", (6, 8)), member("a", "w0", (0, 3)), member("b", "w1", (3, 6))])
    (unit,) = units
    assert unit.instance_id == "a" and unit.kv_blocks_total == 300 and unit.max_batch == summed_batch(3, 64)
