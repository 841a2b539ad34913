"""KunServe through the planner core on constructed views: a burst forms a group and drops
complementary layers; demand falling restores, migrates back and dissolves; a burst returning
mid-restore cancels it back to the dropped group; a refused formation tells the monitor; and
`[policies] buddy_groups = false` decides nothing."""
from __future__ import annotations

from shared.config import ClusterConfig, PoliciesSection
from shared.events.plan import (
    DissolveGroup, DropInstanceLayers, FormGroup, Migrate, PlanApplied, PlanFailed, RestoreInstanceLayers,
)
from shared.events.registry import ModelRecord
from shared.planner import ClusterView, Effect, InstanceView, PlannerCore, RequestView, WorkerView
from shared.planner.kunserve_group_steps import GroupPhase
from shared.planner.kunserve_policy import KunServePolicy
from shared.policy.kunserve_monitor import Phase
from shared.profiles import load_pipeline_profile

from services.planner.policies import build_policies

LAYERS, LAYER_BYTES, BLOCK = 8, 1000, 100  # a block: one layer's KV for a block of tokens
MODEL = ModelRecord(name="m", path="/m", num_layers=LAYERS, max_context=4096, layer_bytes=LAYER_BYTES)


def inst(worker_id: str, used: int, *, total: int = 100, growth: float = 0.0, layers: tuple[int, int] = (0, LAYERS),
         group: str | None = None, requests: tuple[str, ...] = ()) -> WorkerView:
    reqs = tuple(RequestView(rid, prompt_tokens=8, tokens=8, kv_tokens=8, kv_bytes=BLOCK) for rid in requests)
    i = InstanceView(instance_id=f"{worker_id}-m", model="m", worker_id=worker_id, running=len(reqs),
                     kv_blocks_total=total, kv_blocks_used=used, kv_block_bytes=BLOCK, requests=reqs, layers=layers,
                     group_id=group, kv_growth_blocks_per_s=growth)
    return WorkerView(worker_id=worker_id, instances=(i,))


def view(now: float, *workers: WorkerView) -> ClusterView:
    return ClusterView(now=now, workers={w.worker_id: w for w in workers}, models={"m": MODEL})


def burst(now: float) -> ClusterView:
    """Both replicas 1 s from full: 95 of 100 blocks used, growing 10 blocks/s."""
    return view(now, inst("w0", 95, growth=10), inst("w1", 95, growth=10))


def grouped(now: float, used: int, growth: float = 0.0, gid: str = "bg-1-0", requests: bool = True) -> ClusterView:
    """The pair after the drop: 4 layers each, the freed 4000 B as 40 more blocks."""
    return view(now, inst("w0", used, total=140, growth=growth, layers=(0, 4), group=gid,
                          requests=("r0",) if requests else ()),
                inst("w1", used, total=140, growth=growth, layers=(4, 8), group=gid, requests=("r1",) if requests else ()))


def actions(effects: list[Effect]) -> list[object]:
    return [e.actions[0] for e in effects]


def settle(core: PlannerCore, effects: list[Effect], v: ClusterView, *, fail: type | None = None) -> list[Effect]:
    """Apply every effect (or fail those of type `fail`); returns the follow-ups decided at once."""
    more: list[Effect] = []
    for e in effects:
        core.dispatched(e.plan_id)
        if fail is not None and isinstance(e.actions[0], fail):
            core.on_outcome(PlanFailed(plan_id=e.plan_id, ts=v.now, action_index=0, message="refused (unsupported)"))
        else:
            core.on_outcome(PlanApplied(plan_id=e.plan_id, ts=v.now, duration_s=0.1))
        more += core.follow_up(v)
    return more


def make() -> tuple[KunServePolicy, PlannerCore]:
    policy = KunServePolicy(load_pipeline_profile(), kv_block_tokens=16)
    return policy, PlannerCore([policy], id_prefix="t")


def drop_pair(policy: KunServePolicy, core: PlannerCore) -> list[Effect]:
    """The burst at t=0: FormGroup, then (once applied) the complementary drops; returns the drops."""
    formed = core.step(burst(0.0))
    assert [type(a) for a in actions(formed)] == [FormGroup]
    drops = settle(core, formed, burst(0.1))
    assert settle(core, drops, burst(0.2)) == []
    return drops


def test_a_burst_forms_a_group_then_drops_complementary_layers() -> None:
    policy, core = make()
    formed = core.step(burst(0.0))
    (form,) = actions(formed)
    assert isinstance(form, FormGroup) and form.model == "m"
    assert [(m.instance_id, m.layers.start, m.layers.end) for m in form.members] == [("w0-m", 0, 4), ("w1-m", 4, 8)]
    assert formed[0].freed_bytes == 4 * LAYER_BYTES * 2 and formed[0].trigger == "kv_pressure"
    assert core.step(burst(0.05)) == []  # nothing dropped before every member joined
    drops = settle(core, formed, burst(0.1))  # FormGroup applied: the drops follow at once
    assert sorted((a.instance_id, a.layers.start, a.layers.end) for a in actions(drops)) == [
        ("w0-m", 4, 8), ("w1-m", 0, 4)]
    assert all(isinstance(a, DropInstanceLayers) and a.group_id == form.group_id for a in actions(drops))
    settle(core, drops, burst(0.2))
    assert policy.groups("m")[form.group_id].phase == GroupPhase.ACTIVE
    assert policy.phase("m") == Phase.DROPPED
    assert core.step(grouped(0.5, used=100, gid=form.group_id)) == []  # dropped, calm: nothing more


def test_demand_falling_restores_then_dissolves_in_that_order() -> None:
    policy, core = make()
    drop_pair(policy, core)
    assert core.step(grouped(10.0, used=10)) == []  # calm starts: held for restore_hold_s
    restores = core.step(grouped(16.0, used=10))
    assert policy.phase("m") == Phase.RESTORING
    assert sorted((a.instance_id, a.layers.start, a.layers.end) for a in actions(restores)) == [
        ("w0-m", 4, 8), ("w1-m", 0, 4)]
    assert all(isinstance(a, RestoreInstanceLayers) for a in actions(restores))
    first = settle(core, restores[:1], grouped(16.5, used=10))
    assert first == []  # one member still restoring: nothing more yet
    # every layer back: the members migrate their requests back themselves (no Migrate), and the
    # group is dissolved (LeaveGroup is refused busy by a member until nothing would be lost)
    dissolve = settle(core, restores[1:], grouped(16.6, used=10))
    assert [type(a) for a in actions(dissolve)] == [DissolveGroup]
    assert settle(core, dissolve, grouped(17.5, used=10)) == []
    assert policy.groups("m") == {} and policy.phase("m") == Phase.NORMAL
    # the stats still name the dissolved group for a moment: it is not adopted back
    assert core.step(grouped(18.0, used=10)) == [] and policy.groups("m") == {}


def test_a_burst_returning_mid_restore_cancels_it_back_to_the_dropped_group() -> None:
    policy, core = make()
    drop_pair(policy, core)
    core.step(grouped(10.0, used=10))
    restores = core.step(grouped(16.0, used=10))
    assert len(restores) == 2
    # w0's layers came back; w1's restore is still in flight when the burst returns
    assert settle(core, restores[:1], grouped(16.2, used=10)) == []
    again = core.step(grouped(16.5, used=120, growth=30))
    assert policy.phase("m") == Phase.DROPPED
    assert [(type(a), a.instance_id, a.layers.start) for a in actions(again)] == [(DropInstanceLayers, "w0-m", 4)]
    redrop = settle(core, restores[1:], grouped(16.6, used=120, growth=30))  # w1's restore ends: dropped again
    assert [(type(a), a.instance_id, a.layers.start) for a in actions(redrop)] == [(DropInstanceLayers, "w1-m", 0)]
    settle(core, again + redrop, grouped(16.7, used=120, growth=30))
    (group,) = policy.groups("m").values()
    assert group.phase == GroupPhase.ACTIVE and group.dropped == {"w0-m": [(4, 8)], "w1-m": [(0, 4)]}
    assert not any(isinstance(a, (Migrate, DissolveGroup)) for a in actions(again + redrop))


def test_a_refused_formation_is_dissolved_and_the_monitor_told_drop_failed() -> None:
    policy, core = make()
    formed = core.step(burst(0.0))
    assert settle(core, formed, burst(0.1), fail=FormGroup) == []  # a failed step waits for the interval
    cleanup = core.step(burst(1.0))
    assert [type(a) for a in actions(cleanup)] == [DissolveGroup]
    settle(core, cleanup, burst(1.1))
    assert policy.groups("m") == {} and policy.phase("m") == Phase.NORMAL
    assert core.step(burst(2.0)) == []  # backing off: not planned again at once
    assert [type(a) for a in actions(core.step(burst(12.0)))] == [FormGroup]


def test_a_refused_restore_goes_straight_to_dissolving() -> None:
    policy, core = make()
    drop_pair(policy, core)
    core.step(grouped(10.0, used=10))
    restores = core.step(grouped(16.0, used=10))
    settle(core, restores, grouped(16.1, used=10), fail=RestoreInstanceLayers)
    dissolve = core.step(grouped(17.0, used=10))
    assert [type(a) for a in actions(dissolve)] == [DissolveGroup]
    settle(core, dissolve, grouped(17.1, used=10))
    assert policy.phase("m") == Phase.NORMAL


def test_a_group_an_earlier_planner_formed_is_adopted_and_restored() -> None:
    policy, core = make()
    core.step(grouped(0.0, used=10, gid="old-0", requests=False))
    (group,) = policy.groups("m").values()
    assert group.group_id == "old-0" and group.dropped == {"w0-m": [(4, 8)], "w1-m": [(0, 4)]}
    restores = core.step(grouped(5.0, used=10, gid="old-0", requests=False))
    assert sorted(a.instance_id for a in actions(restores)) == ["w0-m", "w1-m"]


def test_prewarmed_bytes_are_spent_before_layers_are_dropped() -> None:
    _, core = make()
    w0, w1 = burst(0.0).workers.values()
    warm = {"prewarm": 2000, "free": 0}
    cheap = view(0.0, WorkerView(worker_id="w0", instances=w0.instances, pool_bytes=warm),
                 WorkerView(worker_id="w1", instances=w1.instances, pool_bytes=warm))
    assert core.step(cheap) == []


def test_buddy_groups_false_constructs_no_kunserve_policy() -> None:
    on = build_policies(ClusterConfig(), group_prefix="bg")
    assert [p.name for p in on] == ["kunserve", "mell"]  # cheapest source of memory first
    off = ClusterConfig(policies=PoliciesSection(buddy_groups=False))
    policies = build_policies(off, group_prefix="bg")
    assert [p.name for p in policies] == ["mell"]
    core = PlannerCore(policies)
    assert not any(isinstance(a, (FormGroup, DropInstanceLayers)) for a in actions(core.step(burst(0.0))))
