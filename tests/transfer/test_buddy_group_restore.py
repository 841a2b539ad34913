"""A buddy group of real worker processes restores, migrates back and dissolves (KunServe §4.3),
and survives its faults (issue item 6): every stream ends with exactly the tokens of an unsplit
run. In order (the last test kills a worker):

* restore while requests decode on both members: RestoreLayers (the record marked `restoring`),
  the owners pull their KV back, LeaveGroup succeeds only then, and the streams go on;
* a KV exchange whose every transfer fails at the keeper (fault injection on w2): the owner
  resends, then its victims fall back to re-prefill;
* a member SIGKILLed mid-pipeline: the survivor notices (heartbeats), restores its layers,
  leaves the group and finishes its requests on its own.
"""
from __future__ import annotations

import asyncio
import signal
from collections.abc import Iterator

import pytest

from migrate_cluster import PROMPT, MigrationCluster, Stream, migration_cluster
from services.gpu_worker.engine.engine import LLMEngine
from shared.bus import Bus
from shared.events.common import GroupMember, LayerRange
from shared.events.ctl import CtlDone, CtlRefused, DropLayers, JoinGroup, LeaveGroup, RestoreLayers
from shared.events.registry import Bucket, GroupRecord
from shared.registry_client import RegistryClient
from test_buddy_group_workers import ctl, expected, start, tokens

pytestmark = pytest.mark.timeout(300)


def members(a: str, b: str) -> list[GroupMember]:
    return [GroupMember(worker_id=a, instance_id=f"{a}-tiny", layers=LayerRange(start=0, end=1)),
            GroupMember(worker_id=b, instance_id=f"{b}-tiny", layers=LayerRange(start=1, end=2))]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[MigrationCluster]:
    with migration_cluster(tmp_path_factory.mktemp("buddy-restore"), ("w0", "w1", "w2"), max_context=2048,
                           step_token_budget=64, worker_env={"w2": {"TIDAL_FAULT_DROP_GROUP_KV": "1"}}) as running:
        yield running


async def form(bus: Bus, group: str, ms: list[GroupMember]) -> None:
    for m in ms:
        joined = await ctl(bus, m.worker_id, JoinGroup(idempotency_key=f"join-{group}-{m.instance_id}", group_id=group,
                                                       instance_id=m.instance_id, members=ms))
        assert isinstance(joined, CtlDone), joined
    for m, other in zip(ms, reversed(ms)):
        dropped = await ctl(bus, m.worker_id, DropLayers(idempotency_key=f"drop-{group}-{m.instance_id}",
                                                         group_id=group, instance_id=m.instance_id, layers=other.layers))
        assert isinstance(dropped, CtlDone), dropped


async def decoding(streams: dict[str, Stream], n: int = 3) -> None:
    """Until every stream has `n` chunks; one that ended with fewer fails the test (it would wait forever)."""
    for rid, s in streams.items():
        while len(s.chunks) < n:
            assert not s.done.is_set(), f"{rid} ended after {len(s.chunks)} chunks, before the step this test needs"
            await asyncio.sleep(0.002)


async def record(bus: Bus, group: str) -> GroupRecord:
    entry = await RegistryClient(bus, timeout=5).get(Bucket.GROUPS, group)
    assert entry is not None and isinstance(entry.record, GroupRecord)
    return entry.record


async def test_restore_migrates_back_then_leaves_token_exact(bus: Bus, reference: LLMEngine) -> None:
    ms = members("w0", "w1")
    reqs = {"rv0": ("w0", PROMPT * 3, None), "rv1": ("w1", PROMPT * 4, 11)}
    streams = {rid: await start(bus, w, rid, p, s) for rid, (w, p, s) in reqs.items()}
    await decoding(streams)
    await form(bus, "gr", ms)
    late = {"rn0": ("w0", PROMPT * 2 + [7], 5), "rn1": ("w1", PROMPT + [9, 9], None)}
    for rid, (w, p, s) in late.items():
        streams[rid] = await start(bus, w, rid, p, s)
    reqs.update(late)
    await decoding(streams, 6)
    early = await ctl(bus, "w0", LeaveGroup(idempotency_key="leave-early", group_id="gr", instance_id="w0-tiny"))
    assert isinstance(early, CtlRefused) and early.code == "busy", early  # its requests are spread over the group
    for m, other in zip(ms, reversed(ms)):
        restored = await ctl(bus, m.worker_id, RestoreLayers(idempotency_key=f"restore-{m.instance_id}",
                                                             instance_id=m.instance_id, layers=other.layers))
        assert isinstance(restored, CtlDone), restored
    assert (await record(bus, "gr")).state == "restoring"  # the dispatcher routes nothing new to it
    pending = {m.worker_id: m for m in ms}
    for attempt in range(400):  # the owners pull their KV back; each member may leave once nothing is lost
        for w, m in list(pending.items()):
            left = await ctl(bus, w, LeaveGroup(idempotency_key=f"leave-{m.instance_id}-{attempt}", group_id="gr",
                                                instance_id=m.instance_id))
            if isinstance(left, CtlDone):
                del pending[w]
            else:
                assert left.code == "busy", left
        if not pending:
            break
        await asyncio.sleep(0.05)
    assert not pending
    assert not all(s.done.is_set() for s in streams.values())  # they left while requests still decoded
    for rid, (w, p, s) in reqs.items():
        assert await tokens(streams[rid]) == expected(reference, p, s), rid
    assert (await record(bus, "gr")).state == "dissolved"


async def test_failed_kv_exchange_falls_back_to_reprefill(bus: Bus, reference: LLMEngine) -> None:
    ms = members("w0", "w2")  # w0's victims send their layer-1 KV to w2, which loses every exchange
    reqs = {"fv0": ("w0", PROMPT * 3, None), "fv1": ("w0", PROMPT * 2, 3), "fv2": ("w2", PROMPT * 4, 11)}
    streams = {rid: await start(bus, w, rid, p, s) for rid, (w, p, s) in reqs.items()}
    await decoding(streams)
    await form(bus, "gf", ms)
    for rid, (w, p, s) in reqs.items():
        assert await tokens(streams[rid]) == expected(reference, p, s), rid
    # nothing of the failed exchange is left behind: both leave, once the finished requests' frees and the
    # last resend's outcome have reached the other member (`busy` until then: a fixed wait raced them)
    for m in ms:
        for attempt in range(600):
            left = await ctl(bus, m.worker_id, LeaveGroup(idempotency_key=f"leave-gf-{m.instance_id}-{attempt}",
                                                          group_id="gf", instance_id=m.instance_id))
            if not (isinstance(left, CtlRefused) and left.code == "busy"):
                break
            await asyncio.sleep(0.05)
        assert isinstance(left, CtlDone), left


async def test_member_killed_mid_pipeline_survivor_runs_alone(bus: Bus, reference: LLMEngine,
                                                              cluster: MigrationCluster) -> None:
    ms = members("w0", "w1")
    reqs = {"kv0": ("w0", PROMPT * 3, None), "kv1": ("w1", PROMPT * 2, 4)}
    streams = {rid: await start(bus, w, rid, p, s) for rid, (w, p, s) in reqs.items()}
    await decoding(streams)
    await form(bus, "gk", ms)
    late = {"kn0": ("w0", PROMPT + [5, 6], 7), "kn1": ("w0", PROMPT * 2 + [8], None)}  # owned by the survivor
    for rid, (w, p, s) in late.items():
        streams[rid] = await start(bus, w, rid, p, s)
    await decoding({rid: streams[rid] for rid in late}, 2)
    cluster.procs["w1"].stop(signal.SIGKILL)
    for rid, (w, p, s) in {**late, "kv0": reqs["kv0"]}.items():  # w1's own requests: the dispatcher's to resume
        assert await tokens(streams[rid]) == expected(reference, p, s), rid
    alone = await start(bus, "w0", "k-alone", PROMPT, None)  # w0 serves on its own, every layer back
    assert await tokens(alone) == expected(reference, PROMPT, None)
    for _ in range(100):
        if (await record(bus, "gk")).state == "dissolved":
            break
        await asyncio.sleep(0.05)
    assert (await record(bus, "gk")).state == "dissolved"
