"""A buddy group of real worker processes loses no work when a member is not what it should be
(issue 22 item 7). Every stream the survivor owns ends with exactly the tokens of an unsplit run,
and the group's record ends `dissolved`, never left `active`:

* JoinGroup naming a member that does not exist (an unknown worker, or a real worker without that
  instance) is refused `not_found` before anything joins;
* a member whose JoinGroup never comes: the joined one rolls back after `JOIN_TIMEOUT_S`;
* a member of a group the planner formed (its `apply_effect`: FormGroup, DropInstanceLayers) SIGKILLed
  and restarted before the registry's `dead_after` (as `tidal up` restarts a worker in under 3 s):
  its heartbeat's new incarnation tells the survivor at once (silence never would), which restores
  every layer and runs alone; LeaveGroup is answered, never `busy`, and the planner's DissolveGroup
  applies at its first attempt.

`dead_after` is 300 s here, so only the incarnation can end the third case within the test: a
restart on a loaded 2-core box (the suite beside other work) took over 30 s, and a survivor that
collapses on silence first reports `silent`, which is not what this case is about.
"""
from __future__ import annotations

import asyncio
import signal
from collections.abc import Iterator

import pytest

from migrate_cluster import PROMPT, MigrationCluster, migration_cluster
from service_procs import wait_ready
from services.gpu_worker.engine.engine import LLMEngine
from shared.bus import Bus
from shared.events import WorkerHeartbeat, WorkerStats
from shared.events.common import GroupMember, LayerRange
from shared.events.ctl import CtlDone, CtlRefused, JoinGroup, LeaveGroup
from shared.events.plan import DissolveGroup, DropInstanceLayers, FormGroup, PlanApplied
from shared.planner import Decision, make_effect
from shared.events.registry import Bucket, GroupRecord
from shared.registry_client import RegistryClient
from shared.subjects import worker_heartbeat, worker_stats
from services.planner.apply import apply_effect
from test_buddy_group_restore import decoding, members
from test_buddy_group_workers import ctl, expected, start, tokens

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[MigrationCluster]:
    with migration_cluster(tmp_path_factory.mktemp("buddy-faults"), ("w0", "w1"), max_context=2048,
                           step_token_budget=64, dead_after="300s") as running:
        yield running


async def planner_applies(bus: Bus, plan_id: str, action: object) -> object:
    """The planner's way: one effect through `services.planner.apply` (registry record, ctl commands)."""
    effect = make_effect(plan_id, Decision(action=action, trigger="kv_pressure"), 1.0)  # type: ignore[arg-type]
    return await apply_effect(bus, effect, timeout_s=30.0)


async def group_state(bus: Bus, group: str) -> str | None:
    entry = await RegistryClient(bus, timeout=5).get(Bucket.GROUPS, group)
    return entry.record.state if entry is not None and isinstance(entry.record, GroupRecord) else None


async def test_join_naming_a_member_that_does_not_exist_is_refused(bus: Bus, reference: LLMEngine) -> None:
    running = {"x0": ("w0", PROMPT * 3, None)}
    streams = {rid: await start(bus, w, rid, p, s) for rid, (w, p, s) in running.items()}
    await decoding(streams)
    ghosts = {"no-worker": GroupMember(worker_id="w9", instance_id="w9-tiny", layers=LayerRange(start=1, end=2)),
              "no-instance": GroupMember(worker_id="w1", instance_id="w1-nope", layers=LayerRange(start=1, end=2))}
    for case, ghost in ghosts.items():
        ms = [members("w0", "w1")[0], ghost]
        reply = await ctl(bus, "w0", JoinGroup(idempotency_key=f"join-{case}", group_id=f"gx-{case}",
                                               instance_id="w0-tiny", members=ms))
        assert isinstance(reply, CtlRefused) and reply.code == "not_found", reply
        assert ghost.instance_id in reply.message and ghost.worker_id in reply.message, reply.message
        assert await group_state(bus, f"gx-{case}") is None  # nothing joined, no record
    for rid, (w, p, s) in running.items():  # w0 never stopped running alone
        assert await tokens(streams[rid]) == expected(reference, p, s), rid


async def test_member_that_never_joins_rolls_the_join_back(bus: Bus, reference: LLMEngine) -> None:
    ms = members("w0", "w1")
    reqs = {"j0": ("w0", PROMPT * 3, None), "j1": ("w0", PROMPT * 2, 5)}
    streams = {rid: await start(bus, w, rid, p, s) for rid, (w, p, s) in reqs.items()}
    await decoding(streams)
    joined = await ctl(bus, "w0", JoinGroup(idempotency_key="join-lonely", group_id="gj", instance_id="w0-tiny",
                                            members=ms))  # w1 is never told: it never runs its stage
    assert isinstance(joined, CtlDone), joined
    late = {"j2": ("w0", PROMPT + [3, 4], None)}  # admitted to the half-formed group
    streams["j2"] = await start(bus, "w0", "j2", *late["j2"][1:])
    for rid, (w, p, s) in {**reqs, **late}.items():
        assert await tokens(streams[rid]) == expected(reference, p, s), rid
    assert await group_state(bus, "gj") == "dissolved"
    left = await ctl(bus, "w0", LeaveGroup(idempotency_key="leave-gj", group_id="gj", instance_id="w0-tiny"))
    assert isinstance(left, CtlDone) and "never_joined" in left.detail, left


async def test_member_killed_and_restarted_is_a_new_incarnation(bus: Bus, reference: LLMEngine,
                                                                cluster: MigrationCluster) -> None:
    incarnations: list[str] = []
    groups: list[tuple[str | None, int, int]] = []

    async def on_heartbeat(hb: WorkerHeartbeat, _ctx: object) -> None:
        if hb.worker_id == "w1" and hb.incarnation not in incarnations:
            incarnations.append(hb.incarnation)

    async def on_stats(st: WorkerStats, _ctx: object) -> None:
        groups.extend((i.group_id, i.layers.start, i.layers.end) for i in st.instances if st.worker_id == "w1")

    await bus.subscribe(worker_heartbeat(), WorkerHeartbeat, on_heartbeat)
    await bus.subscribe(worker_stats(), WorkerStats, on_stats)
    ms = members("w0", "w1")
    reqs = {"r0": ("w0", PROMPT * 3, None), "r1": ("w0", PROMPT * 2, 4)}
    streams = {rid: await start(bus, w, rid, p, s) for rid, (w, p, s) in reqs.items()}
    await decoding(streams)
    formed = await planner_applies(bus, "p-form", FormGroup(group_id="gr", model="tiny", members=ms))
    assert isinstance(formed, PlanApplied) and formed.commands == 2, formed
    for i, (m, other) in enumerate(zip(ms, reversed(ms))):
        dropped = await planner_applies(bus, f"p-drop-{i}", DropInstanceLayers(
            worker_id=m.worker_id, instance_id=m.instance_id, group_id="gr", layers=other.layers))
        assert isinstance(dropped, PlanApplied), dropped
    late = {"r2": ("w0", PROMPT + [5, 6], 7), "r3": ("w0", PROMPT * 2 + [8], None)}  # run across both stages
    for rid, (w, p, s) in late.items():
        streams[rid] = await start(bus, w, rid, p, s)
    await decoding({rid: streams[rid] for rid in late}, 2)
    for _ in range(100):  # the member's stats show its group and the one layer it kept
        if ("gr", 1, 2) in groups:
            break
        await asyncio.sleep(0.05)
    assert ("gr", 1, 2) in groups, groups[-3:]
    for _ in range(100):  # the killed process's incarnation heard first (a heartbeat every 200 ms; all the above
        if incarnations:  # can take less than that)
            break
        await asyncio.sleep(0.05)
    assert len(incarnations) == 1, incarnations
    cluster.procs["w1"].stop(signal.SIGKILL)
    cluster.procs["w1"].start()  # as `tidal up` does
    for rid, (w, p, s) in {**reqs, **late}.items():
        assert await tokens(streams[rid]) == expected(reference, p, s), rid
    left = await ctl(bus, "w0", LeaveGroup(idempotency_key="leave-gr", group_id="gr", instance_id="w0-tiny"))
    assert isinstance(left, CtlDone) and "restarted" in left.detail, left
    assert await group_state(bus, "gr") == "dissolved"
    await wait_ready(bus, cluster.procs["w1"], timeout=180)  # (its heartbeat came: it is loading)
    assert len(incarnations) == 2, incarnations  # the restarted process is another incarnation
    gone = await ctl(bus, "w1", LeaveGroup(idempotency_key="leave-gr-w1", group_id="gr", instance_id="w1-tiny"))
    assert isinstance(gone, CtlRefused) and gone.code == "not_found", gone  # the new process holds no group
    dissolved = await planner_applies(bus, "p-dissolve", DissolveGroup(group_id="gr"))
    assert isinstance(dissolved, PlanApplied), dissolved  # at once: no member answers `busy`
    alone = await start(bus, "w0", "r-alone", PROMPT, None)
    assert await tokens(alone) == expected(reference, PROMPT, None)
