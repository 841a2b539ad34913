"""The dispatcher core and KunServe buddy groups (pure: no NATS, time passed in): requests queued while
the members were full go to the group's entry once its stats show the group, up to §4.3's batch limit."""
from __future__ import annotations

import msgspec
from dispatcher.dispatch_builders import CONFIG, DEAD_AFTER, heartbeat, instance, sends, stats, submit

from shared.events import LayerRange
from shared.policy.kunserve_groups import group_max_batch
from shared.policy.routing_policies import make_policy
from shared.policy.routing_groups import profiled_batch
from shared.profiles import load_pipeline_profile
from services.dispatcher.core import DispatchCore
from services.dispatcher.model_catalog import ModelCatalog
from services.dispatcher.tracked import Phase

PROFILE = load_pipeline_profile()


def member(iid: str, layers: tuple[int, int] | None, *, total: int, used: int, running: int):  # type: ignore[no-untyped-def]
    inst = instance(iid, running=running, used=used, total=total)
    if layers is None:
        return inst
    return msgspec.structs.replace(inst, group_id="g", layers=LayerRange(start=layers[0], end=layers[1]))


def test_requests_queued_on_full_members_are_rebalanced_to_the_group() -> None:
    c = DispatchCore(dispatcher_id="dispatcher-test", policy=make_policy("least-load"),
                     catalog=ModelCatalog.from_config(CONFIG), queue_bound=8, max_redispatches=2,
                     dead_after=DEAD_AFTER, block_size=16, max_batch=4, now=0.0, group_batch=profiled_batch(PROFILE))
    for worker, iid in (("w0", "i0"), ("w1", "i1")):  # both replicas' KV is full: nothing fits
        c.heartbeat(heartbeat(worker), 0.0)
        c.worker_stats(stats(worker, member(iid, None, total=64, used=64, running=1)), 0.0)
    for n in range(5):
        _, effects = c.submit(submit(f"r{n}"), 0.1)
        assert sends(effects) == []
    assert c.count(Phase.QUEUED) == 5
    # the drop: each keeps one of the two layers, the freed bytes are 32 more blocks each
    c.worker_stats(stats("w1", member("i1", (1, 2), total=96, used=64, running=1)), 0.5)
    assert c.count(Phase.QUEUED) == 5  # the entry's stats have not shown the group: incomplete, no route
    effects = c.worker_stats(stats("w0", member("i0", (0, 1), total=96, used=64, running=1)), 0.6)
    limit = group_max_batch(2, 4, PROFILE)  # 6: the pair's compute at the pipeline's efficiency, not 2 x 4
    assert [(s.worker_id, s.assignment.instance_id) for s in sends(effects)] == [("w0", "i0")] * (limit - 2)
    assert c.count(Phase.QUEUED) == 5 - (limit - 2)  # the rest overflow: they wait for room, not pile on


def test_a_group_being_restored_takes_no_new_requests() -> None:
    from shared.events.common import GroupMember
    from shared.events.registry import Bucket, CatalogChanged, GroupRecord

    c = DispatchCore(dispatcher_id="dispatcher-test", policy=make_policy("least-load"),
                     catalog=ModelCatalog.from_config(CONFIG), queue_bound=8, max_redispatches=2,
                     dead_after=DEAD_AFTER, block_size=16, max_batch=4, now=0.0, group_batch=profiled_batch(PROFILE))
    for worker, iid, layers in (("w0", "i0", (0, 1)), ("w1", "i1", (1, 2))):
        c.heartbeat(heartbeat(worker), 0.0)
        c.worker_stats(stats(worker, member(iid, layers, total=96, used=0, running=0)), 0.0)
    members = [GroupMember(worker_id="w0", instance_id="i0", layers=LayerRange(start=0, end=1)),
               GroupMember(worker_id="w1", instance_id="i1", layers=LayerRange(start=1, end=2))]

    def state(s: str, revision: int) -> CatalogChanged:
        return CatalogChanged(bucket=Bucket.GROUPS, key="g", revision=revision, op="put", ts=0.1,
                              record=GroupRecord(group_id="g", model="tiny", members=members, state=s))

    c.heartbeat(heartbeat("w2"), 0.0)  # and an instance in no group
    c.worker_stats(stats("w2", member("i2", None, total=64, used=32, running=2)), 0.0)
    c.catalog_changed(state("restoring", 1), 0.1)
    _, effects = c.submit(submit("r-restoring"), 0.2)
    # the group's members are not routable while it restores: the other instance takes it
    assert [(s.worker_id, s.assignment.instance_id) for s in sends(effects)] == [("w2", "i2")]
    c.catalog_changed(state("active", 2), 0.3)  # the restore was cancelled (a burst came back)
    _, effects = c.submit(submit("r-active"), 0.4)
    assert [(s.worker_id, s.assignment.instance_id) for s in sends(effects)] == [("w0", "i0")]


def test_a_group_being_restored_still_admits_when_it_is_all_the_model_has() -> None:
    """A restore that never ends (a member refusing LeaveGroup) must not leave the model with no
    admitting instance: every request refused 503 no_capacity for as long as it lasts."""
    from shared.events.common import GroupMember
    from shared.events.registry import Bucket, CatalogChanged, GroupRecord

    c = DispatchCore(dispatcher_id="dispatcher-test", policy=make_policy("least-load"),
                     catalog=ModelCatalog.from_config(CONFIG), queue_bound=8, max_redispatches=2,
                     dead_after=DEAD_AFTER, block_size=16, max_batch=4, now=0.0, group_batch=profiled_batch(PROFILE))
    for worker, iid, layers in (("w0", "i0", (0, 1)), ("w1", "i1", (1, 2))):
        c.heartbeat(heartbeat(worker), 0.0)
        c.worker_stats(stats(worker, member(iid, layers, total=96, used=0, running=0)), 0.0)
    members = [GroupMember(worker_id="w0", instance_id="i0", layers=LayerRange(start=0, end=1)),
               GroupMember(worker_id="w1", instance_id="i1", layers=LayerRange(start=1, end=2))]
    c.catalog_changed(CatalogChanged(bucket=Bucket.GROUPS, key="g", revision=1, op="put", ts=0.1, record=GroupRecord(
        group_id="g", model="tiny", members=members, state="restoring")), 0.1)
    reply, effects = c.submit(submit("r-only-group"), 0.2)
    assert type(reply).__name__ == "SubmitAccepted", reply
    assert [(s.worker_id, s.assignment.instance_id) for s in sends(effects)] == [("w0", "i0")]
