"""A buddy group of two real worker processes over the data plane (KunServe §4.1–§4.2).
Requests decoding on each worker when the group forms keep decoding through the drop
(remote attention while their KV is exchanged) and new requests run stage by stage across
the workers; every stream ends with exactly the tokens of an unsplit run (greedy and
seeded). The group is recorded in the registry; leaving restores the layers."""
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
from shared.events.common import GroupMember, LayerRange
from shared.events.ctl import CtlDone, CtlRefused, CtlReply, DropLayers, JoinGroup, LeaveGroup
from shared.events.registry import Bucket, GroupRecord
from shared.registry_client import RegistryClient
from shared.subjects import request_out, worker_assign, worker_ctl

pytestmark = pytest.mark.timeout(240)
MAX_TOKENS = 200
MEMBERS = [GroupMember(worker_id="w0", instance_id="w0-tiny", layers=LayerRange(start=0, end=1)),
           GroupMember(worker_id="w1", instance_id="w1-tiny", layers=LayerRange(start=1, end=2))]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[MigrationCluster]:
    with migration_cluster(tmp_path_factory.mktemp("buddy"), ("w0", "w1"), max_context=2048,
                           step_token_budget=64) as running:
        yield running


def sampling(seed: int | None) -> SamplingParams:
    return SamplingParams(temperature=0.0 if seed is None else 0.8, seed=seed, max_tokens=MAX_TOKENS, ignore_eos=True)


async def start(bus: Bus, worker: str, rid: str, prompt: list[int], seed: int | None) -> Stream:
    stream = Stream()
    await bus.subscribe(request_out(rid), TokenChunk | StreamError, stream.on)
    a = Assignment(idempotency_key=f"{rid}:0", request_id=rid, instance_id=f"{worker}-tiny", model="tiny",
                   prompt_token_ids=prompt, arrival_ts=time.time(), sampling=sampling(seed))
    reply = await bus.request(worker_assign(worker), a, AssignReply)
    assert isinstance(reply, AssignAccepted), reply
    return stream


async def tokens(stream: Stream) -> list[int]:
    await asyncio.wait_for(stream.done.wait(), 180)
    await asyncio.sleep(0.1)
    chunks = sorted(stream.chunks, key=lambda c: c.seq)
    assert not stream.errors, stream.errors
    assert [c.seq for c in chunks] == list(range(len(chunks)))
    return [t for c in chunks for t in c.token_ids]


def expected(reference: LLMEngine, prompt: list[int], seed: int | None) -> list[int]:
    return reference.generate([prompt], engine_params(sampling(seed)))[0].token_ids


async def ctl(bus: Bus, worker: str, msg: object) -> CtlReply:
    return await bus.request(worker_ctl(worker), msg, CtlReply, timeout=60)


async def test_requests_run_token_exact_through_a_drop_and_across_the_group(bus: Bus, reference: LLMEngine) -> None:
    victims = {"v0": ("w0", PROMPT * 3, None), "v1": ("w1", PROMPT * 4, 11)}
    streams = {rid: await start(bus, w, rid, p, s) for rid, (w, p, s) in victims.items()}
    for s in streams.values():  # decoding alone on each worker when the group forms
        while len(s.chunks) < 3:
            await asyncio.sleep(0.002)
    for m in MEMBERS:
        joined = await ctl(bus, m.worker_id, JoinGroup(idempotency_key=f"join-{m.instance_id}", group_id="g1",
                                                       instance_id=m.instance_id, members=MEMBERS))
        assert isinstance(joined, CtlDone), joined
        await asyncio.sleep(0.3)  # w0 runs as a member (sending to w1) before w1 has joined: held there, not lost
    for m, drop in zip(MEMBERS, [LayerRange(start=1, end=2), LayerRange(start=0, end=1)]):
        dropped = await ctl(bus, m.worker_id, DropLayers(idempotency_key=f"drop-{m.instance_id}", group_id="g1",
                                                         instance_id=m.instance_id, layers=drop))
        assert isinstance(dropped, CtlDone) and "released" in dropped.detail, dropped
    late = {"n0": ("w0", PROMPT * 2 + [7], 5), "n1": ("w1", PROMPT + [9, 9], None)}  # stage 0 and stage 1 owners
    for rid, (w, p, s) in late.items():
        streams[rid] = await start(bus, w, rid, p, s)
    for rid, (w, p, s) in {**victims, **late}.items():
        assert await tokens(streams[rid]) == expected(reference, p, s), rid
    entry = await RegistryClient(bus, timeout=5).get(Bucket.GROUPS, "g1")
    assert entry is not None and isinstance(entry.record, GroupRecord) and entry.record.state == "active"
    assert [m.instance_id for m in entry.record.members] == ["w0-tiny", "w1-tiny"]

    overlap = await ctl(bus, "w0", DropLayers(idempotency_key="drop-bad", group_id="g1", instance_id="w0-tiny",
                                              layers=LayerRange(start=0, end=2)))
    assert isinstance(overlap, CtlRefused) and overlap.code == "invalid"
    await asyncio.sleep(0.3)  # the finished requests' frees reach the other member
    for m in MEMBERS:
        left = await ctl(bus, m.worker_id, LeaveGroup(idempotency_key=f"leave-{m.instance_id}", group_id="g1",
                                                      instance_id=m.instance_id))
        assert isinstance(left, CtlDone), left
    entry = await RegistryClient(bus, timeout=5).get(Bucket.GROUPS, "g1")
    assert entry is not None and entry.record.state == "dissolved"
    alone = await start(bus, "w0", "alone", PROMPT, None)  # all layers again, no group
    assert await tokens(alone) == expected(reference, PROMPT, None)


async def test_join_of_an_unknown_instance_is_refused(bus: Bus) -> None:
    reply = await ctl(bus, "w0", JoinGroup(idempotency_key="join-x", group_id="gx", instance_id="w0-nope",
                                           members=MEMBERS))
    assert isinstance(reply, CtlRefused) and reply.code == "not_found"
