"""Token-mode migration between two real worker processes: MigrateIn/MigrateOut on the ctl
subjects move a running request; the client's stream goes on with consecutive sequence
numbers and exactly the tokens of an unmigrated greedy run, with or without an adapter,
mid-prefill or mid-decode; a destination that cannot take it leaves it on the source."""
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
from shared.events.ctl import CtlDone, CtlRefused, CtlReply, MigrateIn, MigrateOut
from shared.subjects import request_out, worker_assign, worker_ctl

pytestmark = pytest.mark.timeout(180)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[MigrationCluster]:
    with migration_cluster(tmp_path_factory.mktemp("migrate"), ("w0", "w1"), max_context=1024,
                           step_token_budget=64) as running:
        yield running


def assign(rid: str, prompt: list[int], adapter: str | None, max_tokens: int) -> Assignment:
    return Assignment(idempotency_key=f"{rid}:0", request_id=rid, instance_id="w0-tiny", model="tiny", adapter=adapter,
                      prompt_token_ids=prompt, arrival_ts=time.time(),
                      sampling=SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True))


async def migrate(bus: Bus, rid: str, source: str, destination: str) -> CtlReply:
    if destination != "w9":  # w9 does not exist
        ready = await bus.request(worker_ctl(destination), MigrateIn(
            idempotency_key=f"in-{rid}", request_id=rid, source=source, instance_id=f"{destination}-tiny",
            mode="tokens"), CtlReply)
        assert isinstance(ready, CtlDone), ready
    return await bus.request(worker_ctl(source), MigrateOut(
        idempotency_key=f"out-{rid}", request_id=rid, destination=destination,
        destination_instance=f"{destination}-tiny", mode="tokens"), CtlReply, timeout=30)


@pytest.mark.parametrize("adapter", [None, "tiny-lora"], ids=["base", "lora"])
@pytest.mark.parametrize("when", ["mid-decode", "mid-prefill"])
async def test_migrated_greedy_request_yields_the_unmigrated_tokens(bus: Bus, reference: LLMEngine, adapter: str | None,
                                                                    when: str) -> None:
    rid = f"mig-{when}-{adapter or 'base'}"
    prompt = PROMPT * 40 if when == "mid-prefill" else PROMPT  # 320 tokens: 5 prefill steps of 64
    max_tokens = 400  # long enough to be still running when the migration arrives on a loaded machine
    stream = Stream()
    await bus.subscribe(request_out(rid), TokenChunk | StreamError, stream.on)
    reply = await bus.request(worker_assign("w0"), assign(rid, prompt, adapter, max_tokens), AssignReply)
    assert isinstance(reply, AssignAccepted)
    if when == "mid-decode":
        while len(stream.chunks) < 3:
            await asyncio.sleep(0.002)
    moved = await migrate(bus, rid, "w0", "w1")
    assert isinstance(moved, CtlDone), moved
    await asyncio.wait_for(stream.done.wait(), 120)
    await asyncio.sleep(0.2)
    chunks = sorted(stream.chunks, key=lambda c: c.seq)
    assert not stream.errors
    assert [c.seq for c in chunks] == list(range(len(chunks)))  # consecutive: no gap, no duplicate
    tokens = [t for c in chunks for t in c.token_ids]
    params = engine_params(SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True))
    assert tokens == reference.generate([prompt], params, adapters=[adapter])[0].token_ids
    owners = [c.worker_id for c in chunks]
    assert owners[-1] == "w1" and owners == sorted(owners)  # w0's chunks (if any), then only w1's
    if when == "mid-decode":
        assert owners[0] == "w0"
    final = chunks[-1]
    assert final.finish_reason == "length" and final.usage is not None
    assert final.usage.completion_tokens == max_tokens and final.usage.prompt_tokens == len(prompt)


async def test_destination_that_cannot_take_it_leaves_the_request_on_the_source(bus: Bus, reference: LLMEngine) -> None:
    rid = "mig-nowhere"
    stream = Stream()
    await bus.subscribe(request_out(rid), TokenChunk | StreamError, stream.on)
    await bus.request(worker_assign("w0"), assign(rid, PROMPT, None, 150), AssignReply)
    while len(stream.chunks) < 3:
        await asyncio.sleep(0.002)
    refused = await migrate(bus, rid, "w0", "w9")  # no such worker: nobody answers its assign subject
    assert isinstance(refused, CtlRefused) and refused.code == "busy"
    await asyncio.wait_for(stream.done.wait(), 120)
    chunks = sorted(stream.chunks, key=lambda c: c.seq)
    assert [c.seq for c in chunks] == list(range(len(chunks))) and {c.worker_id for c in chunks} == {"w0"}
    params = engine_params(SamplingParams(temperature=0.0, max_tokens=150, ignore_eos=True))
    assert [t for c in chunks for t in c.token_ids] == reference.generate([PROMPT], params)[0].token_ids


async def test_unknown_requests_are_refused(bus: Bus) -> None:
    kv = await bus.request(worker_ctl("w0"), MigrateOut(idempotency_key="kv-1", request_id="nope", destination="w1",
                                                       destination_instance="w1-tiny", mode="kv"), CtlReply)
    assert isinstance(kv, CtlRefused) and kv.code == "not_found"  # KV mode: tests/transfer/test_migrate_kv.py
    gone = await bus.request(worker_ctl("w0"), MigrateOut(idempotency_key="t-1", request_id="nope", destination="w1",
                                                         destination_instance="w1-tiny", mode="tokens"), CtlReply)
    assert isinstance(gone, CtlRefused) and gone.code == "not_found"
