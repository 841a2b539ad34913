"""KunServe's effects applied for real: a nats-server, a registry process and a gpu_worker process
(a tiny model), the planner's `apply_effect` in between. The mapping to typed ctl commands is
checked purely; live, a group is recorded in the registry before any member is asked, a refusal
from the real worker is a PlanFailed the policy reacts to, and a dissolve resolves its members
from the registry record."""
from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from shared.bus import Bus, BusSettings
from shared.events.common import GroupMember, LayerRange
from shared.events.ctl import DropLayers, JoinGroup, LeaveGroup, RestoreLayers
from shared.events.plan import (
    DissolveGroup, DropInstanceLayers, FormGroup, PlanApplied, PlanFailed, RestoreInstanceLayers,
)
from shared.events.registry import Bucket, GroupRecord, ModelRecord
from shared.planner import ClusterView, Decision, InstanceView, PlannerCore, WorkerView, ctl_commands, make_effect
from shared.planner.kunserve_policy import KunServePolicy
from shared.policy.kunserve_monitor import Phase
from shared.profiles import load_pipeline_profile
from shared.registry_client import RegistryClient

from service_procs import FAST_LIVENESS, registry_and_worker
from services.gpu_worker.engine.checkpoint_gen import make_model
from services.planner.apply import apply_effect

pytestmark = pytest.mark.timeout(240)

MODEL, INSTANCE = "tiny", "w0-tiny"
CONFIG = FAST_LIVENESS + """
[[models]]
name = "tiny"
path = "{model}"
max_context = 512

[[workers]]
id = "w0"
device = "cpu"
memory = "64MiB"
models = ["tiny"]

[policies]
kv_block_tokens = 8
"""


def make_assets(directory: Path) -> Path:
    model = make_model(directory / "tiny", arch="llama", layers=2, hidden=64, heads=4, kv_heads=2, vocab=512, seed=3)
    path = directory / "cluster.toml"
    path.write_text(CONFIG.format(model=model))
    return path

REAL = GroupMember(worker_id="w0", instance_id=INSTANCE, layers=LayerRange(start=0, end=1))
ABSENT = GroupMember(worker_id="w9", instance_id="w9-tiny", layers=LayerRange(start=1, end=2))


def effect(pid: str, action: object) -> object:
    return make_effect(pid, Decision(action=action, trigger="kv_pressure"), 1.0)  # type: ignore[arg-type]


def test_effects_map_to_typed_ctl_commands() -> None:
    form = ctl_commands(effect("e-1", FormGroup(group_id="g", model=MODEL, members=[REAL, ABSENT])))
    assert [(w, type(c), c.idempotency_key) for w, c in form] == [("w0", JoinGroup, "e-1:0"), ("w9", JoinGroup, "e-1:1")]
    assert all(c.members == [REAL, ABSENT] and c.plan_id == "e-1" for _, c in form)
    drop = ctl_commands(effect("e-2", DropInstanceLayers(worker_id="w0", instance_id=INSTANCE, group_id="g",
                                                         layers=LayerRange(start=1, end=2))))
    assert drop == [("w0", DropLayers(idempotency_key="e-2:0", plan_id="e-2", instance_id=INSTANCE, group_id="g",
                                      layers=LayerRange(start=1, end=2)))]
    restore = ctl_commands(effect("e-3", RestoreInstanceLayers(worker_id="w0", instance_id=INSTANCE,
                                                               layers=LayerRange(start=1, end=2))))
    assert [type(c) for _, c in restore] == [RestoreLayers]
    dissolve = effect("e-4", DissolveGroup(group_id="g"))
    with pytest.raises(ValueError, match="needs the group's members"):
        ctl_commands(dissolve)
    leave = ctl_commands(dissolve, group_members=[REAL, ABSENT])
    assert [(w, c) for w, c in leave] == [
        ("w0", LeaveGroup(idempotency_key="e-4:0", plan_id="e-4", group_id="g", instance_id=INSTANCE)),
        ("w9", LeaveGroup(idempotency_key="e-4:1", plan_id="e-4", group_id="g", instance_id="w9-tiny"))]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    directory: Path = tmp_path_factory.mktemp("kunserve-apply")
    with registry_and_worker(directory, make_assets(directory), timeout=90) as url:
        yield url


@pytest.fixture
async def bus(cluster: str):  # type: ignore[no-untyped-def]
    bus = await Bus.connect(BusSettings(url=cluster), service="planner")
    yield bus
    await bus.close()


def burst(now: float) -> ClusterView:
    """The real worker's instance and an absent one, both 1 s from full: KunServe pairs them."""
    record = ModelRecord(name=MODEL, path="/m", num_layers=2, max_context=512, layer_bytes=1000)
    workers = {}
    for member in (REAL, ABSENT):
        inst = InstanceView(instance_id=member.instance_id, model=MODEL, worker_id=member.worker_id,
                            kv_blocks_total=100, kv_blocks_used=95, kv_block_bytes=100, kv_growth_blocks_per_s=10,
                            layers=(0, 2))
        workers[member.worker_id] = WorkerView(worker_id=member.worker_id, instances=(inst,))
    return ClusterView(now=now, workers=workers, models={MODEL: record})


async def group_record(bus: Bus, group_id: str) -> GroupRecord | None:
    entry = await RegistryClient(bus, timeout=5.0).get(Bucket.GROUPS, group_id)
    return entry.record if entry is not None else None  # type: ignore[return-value]


async def test_a_refused_formation_reaches_the_policy_and_is_dissolved_from_the_record(bus: Bus) -> None:
    policy = KunServePolicy(load_pipeline_profile(), group_prefix="live")
    core = PlannerCore([policy], id_prefix="live")
    (form,) = core.step(burst(0.0))
    action = form.actions[0]
    assert isinstance(action, FormGroup) and [m.worker_id for m in action.members] == ["w0", "w9"]
    core.dispatched(form.plan_id)
    outcome = await apply_effect(bus, form, timeout_s=5.0)
    # w0 checks every member before it joins: w9 runs no worker, so nothing joins anywhere
    assert isinstance(outcome, PlanFailed) and "JoinGroup refused by w0 (not_found): member w9-tiny" in outcome.message
    record = await group_record(bus, action.group_id)  # written before any member was asked
    assert record is not None and record.members == action.members and record.plan_id == form.plan_id
    core.on_outcome(outcome)
    (dissolve,) = core.step(burst(1.0))  # a failed step waits for the interval, then the cleanup
    assert dissolve.actions == [DissolveGroup(group_id=action.group_id)]
    core.dispatched(dissolve.plan_id)
    left = await apply_effect(bus, dissolve, timeout_s=5.0)  # members from the record; w9 runs no worker
    assert isinstance(left, PlanApplied) and left.commands == 2
    record = await group_record(bus, action.group_id)
    assert record is not None and record.state == "dissolved"
    core.on_outcome(left)
    core.follow_up(burst(1.1))
    assert policy.groups(MODEL) == {} and policy.phase(MODEL) == Phase.NORMAL  # drop_failed: back to normal
    assert core.step(burst(2.0)) == []  # and it backs off rather than asking the worker again at once


async def test_the_real_worker_refuses_layer_commands_outside_a_group_as_plan_failed(bus: Bus) -> None:
    drop = effect("live-d", DropInstanceLayers(worker_id="w0", instance_id=INSTANCE, group_id="nogroup",
                                               layers=LayerRange(start=1, end=2)))
    failed = await apply_effect(bus, drop, timeout_s=5.0)
    assert isinstance(failed, PlanFailed) and "DropLayers refused by w0" in failed.message
    restore = effect("live-r", RestoreInstanceLayers(worker_id="w0", instance_id=INSTANCE,
                                                     layers=LayerRange(start=1, end=2)))
    restored = await apply_effect(bus, restore, timeout_s=5.0)  # resident already: idempotent, nothing to load
    assert isinstance(restored, PlanApplied), restored
    unknown = effect("live-u", RestoreInstanceLayers(worker_id="w0", instance_id="w0-nope",
                                                    layers=LayerRange(start=1, end=2)))
    refused = await apply_effect(bus, unknown, timeout_s=5.0)
    assert isinstance(refused, PlanFailed) and "RestoreLayers refused by w0 (not_found)" in refused.message
    missing = await apply_effect(bus, effect("live-x", DissolveGroup(group_id="never-formed")), timeout_s=5.0)
    assert isinstance(missing, PlanFailed) and "never-formed has no record" in missing.message
