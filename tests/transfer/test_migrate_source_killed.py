"""A KV migration whose source is SIGKILLed mid pre-copy loses no work (issue 22 item 7).

The MigrateOut sent to the source is never answered (the caller's bus request ends with a typed
`DeadlineExceeded`). The destination still holds a KV reservation for the request when the
dispatcher re-dispatches it there (resume tokens, next sequence number): that assignment runs at
once, re-prefilling, instead of waiting on the dead transfer and refusing. A reservation the dead
source made and nobody re-dispatches is released once the source is lost (a 1 h hold: only the
source's liveness can end it here).
"""
from __future__ import annotations

import asyncio
import os
import signal
import time
from collections.abc import Iterator

import pytest

from migrate_cluster import PROMPT, MigrationCluster, migration_cluster
from services.gpu_worker.engine.engine import LLMEngine
from shared.bus import Bus, Delivery
from shared.events import AssignAccepted, AssignReply, Assignment, SamplingParams, WorkerStats
from shared.events.ctl import CtlDone, CtlReply, MigrateIn, MigrateKvStage, MigrateOut, MigrateRequest
from shared.subjects import worker_assign, worker_ctl, worker_migrate, worker_stats
from shared.wire import DeadlineExceeded, NoResponders
from test_migrate_kv import Stats, finished, start

pytestmark = pytest.mark.timeout(180)
# The request must still be generating when the source is killed at its first pre-copy stage: ~300
# tokens pass between the MigrateOut and that stage on a quiet box, and under `make test` on a loaded
# one the source once streamed all of test_migrate_kv's 1000 first (the re-dispatch then had nothing
# left to generate). 6000 tokens (~6 s here) on a model whose positions allow them.
MAX_TOKENS = 6000


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[MigrationCluster]:
    with migration_cluster(tmp_path_factory.mktemp("migrate-src-killed"), ("w0", "w1"), max_context=8192,
                           step_token_budget=32, max_position=8192) as running:
        yield running


async def test_source_killed_mid_precopy_then_redispatched_to_the_destination(
        bus: Bus, reference: LLMEngine, cluster: MigrationCluster) -> None:
    rid, prompt = "src-killed", PROMPT * 30
    source = cluster.procs["w0"]
    stats = Stats()
    await bus.subscribe(worker_stats(), WorkerStats, stats.on)
    orphan = await bus.request(worker_migrate("w1"), MigrateIn(  # as the source reserves for another move
        idempotency_key="orphan", request_id="orphan", source="w0", instance_id="w1-tiny", mode="kv",
        reserve_tokens=100, kv_block_tokens=8, hold_s=3600), CtlReply)
    assert isinstance(orphan, CtlDone), orphan

    async def kill(msg: object, _ctx: Delivery) -> None:  # the source's first stage: the pre-copy is under way
        if isinstance(msg, MigrateKvStage) and source.proc is not None and source.proc.poll() is None:
            os.killpg(source.pid, signal.SIGKILL)

    await bus.subscribe(worker_migrate("w1"), MigrateRequest, kill)
    stream = await start(bus, rid, prompt, None, MAX_TOKENS)
    while len(stream.chunks) < 3:
        await asyncio.sleep(0.002)
    out = asyncio.ensure_future(bus.request(worker_ctl("w0"), MigrateOut(
        idempotency_key=f"out-{rid}", request_id=rid, destination="w1", destination_instance="w1-tiny",
        mode="kv"), CtlReply, timeout=5))
    assert source.proc is not None and await asyncio.to_thread(source.proc.wait, 10) == -signal.SIGKILL
    await asyncio.sleep(0.2)  # the source's last chunks, if any, are in (well inside dead_after)
    assert not stream.done.is_set(), "the request ended on the source before its pre-copy began: nothing to re-dispatch"
    chunks = sorted(stream.chunks, key=lambda c: c.seq)
    redispatch = Assignment(  # what the dispatcher sends once the source is lost
        idempotency_key=f"{rid}:1", request_id=rid, instance_id="w1-tiny", model="tiny", prompt_token_ids=prompt,
        arrival_ts=time.time(), sampling=SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True), attempt=1,
        resume_token_ids=[t for c in chunks for t in c.token_ids], next_seq=chunks[-1].seq + 1)
    reply = await bus.request(worker_assign("w1"), redispatch, AssignReply, timeout=10)
    assert isinstance(reply, AssignAccepted), reply  # not kv_unavailable after a wait on the dead transfer
    with pytest.raises((DeadlineExceeded, NoResponders)):  # nobody will ever answer the MigrateOut
        await out
    done = await finished(stream, reference, prompt, None, MAX_TOKENS)
    assert done[-1].worker_id == "w1"
    for _ in range(200):  # the orphan's reservation goes too: its source is lost
        if await stats.kv_used("w1", after=time.time()) == 0:
            break
    assert await stats.kv_used("w1", after=time.time()) == 0

