"""A buddy group stuck `restoring` is dissolved by force (issue 27 item 2), with two real worker processes.

w0 restores its layers and migrates its requests back (it runs alone), but w1 is never restored:
its requests keep running through w0's stage, so w0 holds their KV and LeaveGroup is refused
`busy` — for ever, before this fix, and the dispatcher would keep the group out of routing. Past
the deadline (`TIDAL_GROUP_FORCE_LEAVE_AFTER_S`, 3 s here instead of 150 s) w0's LeaveGroup leaves
by force: it collapses as for a lost peer; w1 sees it left and collapses in turn. Every stream of
both owners ends with exactly the tokens of an unsplit run; the record ends `dissolved`, and w1's
LeaveGroup is answered too.
"""
from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator

import pytest

from migrate_cluster import PROMPT, MigrationCluster, Stream, migration_cluster
from services.gpu_worker.engine.engine import LLMEngine
from services.gpu_worker.instance import engine_params
from shared.bus import Bus
from shared.events import AssignAccepted, AssignReply, Assignment, SamplingParams, StreamError, TokenChunk
from shared.events.ctl import CtlDone, CtlRefused, LeaveGroup, RestoreLayers
from shared.subjects import request_out, worker_assign
from test_buddy_group_restore import decoding, form, members, record
from test_buddy_group_workers import ctl, tokens

pytestmark = pytest.mark.timeout(420)
FORCE_AFTER_S = 3
LONG = SamplingParams(temperature=0.0, max_tokens=1800, ignore_eos=True)  # still decoding past the deadline


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[MigrationCluster]:
    env = {"TIDAL_GROUP_FORCE_LEAVE_AFTER_S": str(FORCE_AFTER_S)}
    with migration_cluster(tmp_path_factory.mktemp("buddy-stuck"), ("w0", "w1"), max_context=2048,
                           step_token_budget=64, worker_env={"w0": env, "w1": env}) as running:
        yield running


async def start(bus: Bus, worker: str, rid: str, prompt: list[int]) -> Stream:
    stream = Stream()
    await bus.subscribe(request_out(rid), TokenChunk | StreamError, stream.on)
    a = Assignment(idempotency_key=f"{rid}:0", request_id=rid, instance_id=f"{worker}-tiny", model="tiny",
                   prompt_token_ids=prompt, arrival_ts=time.time(), sampling=LONG)
    reply = await bus.request(worker_assign(worker), a, AssignReply)
    assert isinstance(reply, AssignAccepted), reply
    return stream


async def test_a_member_refused_leave_past_the_deadline_leaves_by_force(bus: Bus, reference: LLMEngine) -> None:
    ms = members("w0", "w1")
    reqs = {"s0": ("w0", PROMPT * 3), "s1": ("w1", PROMPT * 4)}
    streams = {rid: await start(bus, w, rid, p) for rid, (w, p) in reqs.items()}
    await decoding(streams)
    await form(bus, "gs", ms)
    late = {"s2": ("w0", PROMPT * 2 + [7]), "s3": ("w1", PROMPT + [9, 9])}  # owned by each stage
    for rid, (w, p) in late.items():
        streams[rid] = await start(bus, w, rid, p)
    reqs.update(late)
    await decoding(streams, 6)
    restored = await ctl(bus, "w0", RestoreLayers(idempotency_key="restore-w0", instance_id="w0-tiny",
                                                  layers=ms[1].layers))  # w1 is never restored
    assert isinstance(restored, CtlDone), restored
    refused = await ctl(bus, "w0", LeaveGroup(idempotency_key="leave-w0-early", group_id="gs", instance_id="w0-tiny"))
    assert isinstance(refused, CtlRefused) and refused.code == "busy", refused  # w1's requests run through it
    left = refused
    for attempt in range(600):  # as the planner retries DissolveGroup
        left = await ctl(bus, "w0", LeaveGroup(idempotency_key=f"leave-w0-{attempt}", group_id="gs",
                                               instance_id="w0-tiny"))
        if isinstance(left, CtlDone):
            break
        assert left.code == "busy", left
        await asyncio.sleep(0.2)
    assert isinstance(left, CtlDone) and "by force" in left.detail, left
    assert not streams["s1"].done.is_set() and not streams["s3"].done.is_set()  # w1 still needed w0's stage
    for rid, (w, p) in reqs.items():
        assert await tokens(streams[rid]) == reference.generate([p], engine_params(LONG))[0].token_ids, rid
    for _ in range(100):
        if (await record(bus, "gs")).state == "dissolved":
            break
        await asyncio.sleep(0.1)
    assert (await record(bus, "gs")).state == "dissolved"
    gone = await ctl(bus, "w1", LeaveGroup(idempotency_key="leave-w1", group_id="gs", instance_id="w1-tiny"))
    assert isinstance(gone, CtlDone) and "w0-tiny" in gone.detail, gone  # it collapsed when w0 left
