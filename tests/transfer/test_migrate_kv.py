"""KV-mode live migration (Llumnix pre-copy) between real worker processes over the data plane.

A running greedy request moves with its KV blocks: the client's stream goes on with
consecutive sequence numbers and exactly the tokens of an unmigrated run (mid-decode and
mid-prefill, with and without a LoRA adapter), later chunks carry the new worker_id, and the
source's blocks are freed. A destination killed during the pre-copy leaves the request on
the source, exact; a corrupted chunk (TIDAL_FAULT_CORRUPT_INBOUND_KV on the destination)
makes the move fall back to token mode, exact; an uncommitted reservation expires.
"""
from __future__ import annotations

import asyncio
import os
import signal
import time
from collections.abc import Iterator

import pytest

from migrate_cluster import PROMPT, MigrationCluster, Stream, migration_cluster
from services.gpu_worker.dataplane import FAULT_CORRUPT_INBOUND_KV
from services.gpu_worker.engine.engine import LLMEngine
from services.gpu_worker.instance import engine_params
from shared.bus import Bus, Delivery
from shared.events import AssignAccepted, AssignReply, Assignment, SamplingParams, StreamError, TokenChunk, WorkerStats
from shared.events.ctl import (
    CtlDone, CtlRefused, CtlReply, MigrateIn, MigrateKvCancel, MigrateKvStage, MigrateOut, MigrateRequest,
)
from shared.subjects import request_out, worker_assign, worker_ctl, worker_migrate, worker_stats

pytestmark = pytest.mark.timeout(180)

WORKERS = ("w0", "w1", "w2", "w3", "w4")  # w0 source, w1 destination, w2 corrupts inbound KV, w3/w4 are killed
MAX_TOKENS = 1000  # ~1 ms a token here: long enough to still run when the move is done, under load too


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[MigrationCluster]:
    with migration_cluster(tmp_path_factory.mktemp("migrate-kv"), WORKERS, max_context=2048, step_token_budget=32,
                           worker_env={"w2": {FAULT_CORRUPT_INBOUND_KV: "1"}}) as running:
        yield running


class Stats:
    """The latest WorkerStats of every worker."""

    def __init__(self) -> None:
        self.latest: dict[str, WorkerStats] = {}

    async def on(self, msg: WorkerStats, _ctx: Delivery) -> None:
        self.latest[msg.worker_id] = msg

    async def kv_used(self, worker: str, *, after: float) -> int:
        """KV blocks in use on `worker` in its first stats published after `after` (time.time())."""
        while True:
            msg = self.latest.get(worker)
            if msg is not None and msg.ts > after:
                return sum(i.kv_blocks_used for i in msg.instances)
            await asyncio.sleep(0.02)


async def start(bus: Bus, rid: str, prompt: list[int], adapter: str | None, max_tokens: int = MAX_TOKENS) -> Stream:
    stream = Stream()
    await bus.subscribe(request_out(rid), TokenChunk | StreamError, stream.on)
    a = Assignment(idempotency_key=f"{rid}:0", request_id=rid, instance_id="w0-tiny", model="tiny", adapter=adapter,
                   prompt_token_ids=prompt, arrival_ts=time.time(),
                   sampling=SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True))
    reply = await bus.request(worker_assign("w0"), a, AssignReply)
    assert isinstance(reply, AssignAccepted), reply
    return stream


async def migrate_out(bus: Bus, rid: str, destination: str) -> CtlReply:
    return await bus.request(worker_ctl("w0"), MigrateOut(
        idempotency_key=f"out-{rid}", request_id=rid, destination=destination,
        destination_instance=f"{destination}-tiny", mode="kv"), CtlReply, timeout=60)


async def finished(stream: Stream, reference: LLMEngine, prompt: list[int], adapter: str | None,
                   max_tokens: int = MAX_TOKENS) -> list[TokenChunk]:
    """The stream's chunks once it ended: consecutive seqs, the unmigrated run's tokens, full usage."""
    await asyncio.wait_for(stream.done.wait(), 120)
    await asyncio.sleep(0.2)  # a duplicate or late chunk would show up now
    chunks = sorted(stream.chunks, key=lambda c: c.seq)
    assert not stream.errors
    assert [c.seq for c in chunks] == list(range(len(chunks)))  # consecutive: no gap, no duplicate
    params = engine_params(SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True))
    assert [t for c in chunks for t in c.token_ids] == reference.generate([prompt], params, adapters=[adapter])[0].token_ids
    final = chunks[-1]
    assert final.finish_reason == "length" and final.usage is not None
    assert final.usage.completion_tokens == max_tokens and final.usage.prompt_tokens == len(prompt)
    return chunks


@pytest.mark.parametrize("adapter", [None, "tiny-lora"], ids=["base", "lora"])
@pytest.mark.parametrize("when", ["mid-decode", "mid-prefill"])
async def test_kv_migrated_greedy_request_yields_the_unmigrated_tokens(bus: Bus, reference: LLMEngine,
                                                                       adapter: str | None, when: str) -> None:
    rid = f"kv-{when}-{adapter or 'base'}"
    prompt = PROMPT * 40 if when == "mid-prefill" else PROMPT * 6  # 320 tokens: 10 prefill steps of 32
    stats = Stats()
    await bus.subscribe(worker_stats(), WorkerStats, stats.on)
    stream = await start(bus, rid, prompt, adapter)
    if when == "mid-decode":
        while len(stream.chunks) < 5:
            await asyncio.sleep(0.002)
    moved = await migrate_out(bus, rid, "w1")
    assert isinstance(moved, CtlDone), moved
    report = moved.migration
    assert report is not None and report.mode == "kv" and report.requested_mode == "kv" and not report.fallback
    assert report.stages >= 1 and report.kv_bytes > 0 and 0 < report.kv_tokens < report.tokens
    assert 0 < report.downtime_s < report.total_s
    if when == "mid-decode":
        assert report.kv_tokens > len(prompt)  # its decoded tokens' KV moved too
    moved_at = time.time()
    assert await stats.kv_used("w0", after=moved_at) == 0  # the source freed its blocks at once
    chunks = await finished(stream, reference, prompt, adapter)
    owners = [c.worker_id for c in chunks]
    assert owners[-1] == "w1" and owners == sorted(owners)  # w0's chunks (if any), then only w1's
    if when == "mid-decode":
        assert owners[0] == "w0"
    assert await stats.kv_used("w1", after=time.time()) == 0  # the reservation became the request's; freed at its end


@pytest.mark.parametrize("when", ["first-stage", "final-stop"])
async def test_destination_killed_during_the_migration_leaves_the_request_on_the_source(
        bus: Bus, reference: LLMEngine, cluster: MigrationCluster, when: str) -> None:
    """Killed at the first pre-copy stage, the request never stopped; killed at the final stop,
    the source has taken it out of its engine and must attach it back on its held blocks."""
    rid = f"kv-dest-killed-{when}"
    prompt = PROMPT * 30
    victim_id = "w3" if when == "first-stage" else "w4"
    victim = cluster.procs[victim_id]

    async def kill(msg: object, _ctx: Delivery) -> None:  # we see the victim's migration traffic too
        if isinstance(msg, MigrateKvStage) and (msg.final or when == "first-stage") and victim.proc.poll() is None:
            os.killpg(victim.pid, signal.SIGKILL)

    assert victim.proc is not None
    await bus.subscribe(worker_migrate(victim_id), MigrateRequest, kill)
    stats = Stats()
    await bus.subscribe(worker_stats(), WorkerStats, stats.on)
    stream = await start(bus, rid, prompt, None)
    while len(stream.chunks) < 3:
        await asyncio.sleep(0.002)
    refused = await migrate_out(bus, rid, victim_id)
    assert victim.proc.wait(10) == -signal.SIGKILL  # it really died mid-migration
    assert isinstance(refused, CtlRefused) and refused.code == "busy", refused
    chunks = await finished(stream, reference, prompt, None)
    assert {c.worker_id for c in chunks} == {"w0"}
    assert await stats.kv_used("w0", after=time.time()) == 0  # nothing left held after it ended


async def test_corrupted_chunk_falls_back_to_token_mode(bus: Bus, reference: LLMEngine) -> None:
    rid = "kv-corrupt"
    prompt = PROMPT * 6
    stats = Stats()
    await bus.subscribe(worker_stats(), WorkerStats, stats.on)
    stream = await start(bus, rid, prompt, "tiny-lora")
    while len(stream.chunks) < 3:
        await asyncio.sleep(0.002)
    moved = await migrate_out(bus, rid, "w2")  # w2 flips a byte of every inbound transfer's first chunk
    assert isinstance(moved, CtlDone), moved
    report = moved.migration
    assert report is not None and report.requested_mode == "kv" and report.mode == "tokens"
    assert report.fallback.startswith("corrupt"), report.fallback
    chunks = await finished(stream, reference, prompt, "tiny-lora")
    owners = [c.worker_id for c in chunks]
    assert owners[0] == "w0" and owners[-1] == "w2" and owners == sorted(owners)
    after = time.time()
    assert await stats.kv_used("w0", after=after) == 0 and await stats.kv_used("w2", after=after) == 0


async def test_uncommitted_reservation_is_released_after_its_hold(bus: Bus) -> None:
    stats = Stats()
    await bus.subscribe(worker_stats(), WorkerStats, stats.on)
    reply = await bus.request(worker_migrate("w1"), MigrateIn(
        idempotency_key="kv-hold", request_id="kv-hold", source="w0", instance_id="w1-tiny", mode="kv",
        reserve_tokens=100, kv_block_tokens=8, hold_s=0.6), CtlReply)
    assert isinstance(reply, CtlDone), reply
    assert await stats.kv_used("w1", after=time.time()) == 13 * 2  # 100 tokens: 13 blocks on each of 2 layers
    await asyncio.sleep(1.2)  # nobody sends a stage or a commit: the source is "dead"
    assert await stats.kv_used("w1", after=time.time()) == 0
    mismatch = await bus.request(worker_migrate("w1"), MigrateIn(
        idempotency_key="kv-bs", request_id="kv-bs", source="w0", instance_id="w1-tiny", mode="kv",
        reserve_tokens=100, kv_block_tokens=16), CtlReply)
    assert isinstance(mismatch, CtlRefused) and mismatch.code == "invalid"


async def test_kv_migration_of_an_unknown_request_is_refused(bus: Bus) -> None:
    gone = await migrate_out(bus, "nope", "w1")
    assert isinstance(gone, CtlRefused) and gone.code == "not_found"


async def test_a_committed_move_the_source_gave_up_on_is_withdrawn_quietly(bus: Bus) -> None:
    """The source's commit went unanswered (retried under one key, then given up): it resumes the
    request itself and cancels; the destination, which did attach, drops its copy WITHOUT a final
    chunk, so the client's stream is not ended by the copy nobody owns any more."""
    rid = "kv-withdrawn"
    stats = Stats()
    await bus.subscribe(worker_stats(), WorkerStats, stats.on)
    stream = await start(bus, rid, PROMPT * 6, None)
    while len(stream.chunks) < 3:
        await asyncio.sleep(0.002)
    moved = await migrate_out(bus, rid, "w1")
    assert isinstance(moved, CtlDone) and moved.migration is not None and moved.migration.mode == "kv", moved
    while not any(c.worker_id == "w1" for c in stream.chunks):
        await asyncio.sleep(0.002)
    reply = await bus.request(worker_migrate("w1"), MigrateKvCancel(
        idempotency_key="kv-withdraw", request_id=rid, source="w0", reason="commit unanswered"), CtlReply)
    assert isinstance(reply, CtlDone) and reply.detail.endswith("the source continues it"), reply
    assert await stats.kv_used("w1", after=time.time()) == 0
    seen = len(stream.chunks)
    await asyncio.sleep(0.3)
    assert len(stream.chunks) == seen and not stream.done.is_set() and not stream.errors
    other = await bus.request(worker_migrate("w1"), MigrateKvCancel(
        idempotency_key="kv-withdraw-2", request_id=rid, source="w3", reason="not its move"), CtlReply)
    assert isinstance(other, CtlDone) and other.detail.startswith("no reservation"), other


async def run_to_end(bus: Bus, worker: str, rid: str, prompt: list[int], max_tokens: int) -> list[int]:
    stream = Stream()
    await bus.subscribe(request_out(rid), TokenChunk | StreamError, stream.on)
    a = Assignment(idempotency_key=f"{rid}:0", request_id=rid, instance_id=f"{worker}-tiny", model="tiny",
                   prompt_token_ids=prompt, arrival_ts=time.time(),
                   sampling=SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True))
    reply = await bus.request(worker_assign(worker), a, AssignReply)
    assert isinstance(reply, AssignAccepted), reply
    await asyncio.wait_for(stream.done.wait(), 60)
    assert not stream.errors
    return [t for c in sorted(stream.chunks, key=lambda c: c.seq) for t in c.token_ids]


async def test_kv_migration_of_a_request_on_cached_prefix_blocks(bus: Bus, reference: LLMEngine) -> None:
    """Prefix caching (on by default): both workers hold the prompt's blocks cached, so the source
    admits the request on shared blocks; they move like any other (copied into fresh blocks at the
    destination, which holds the same names cached) and the tokens are the unmigrated run's. Later
    requests hitting either worker's cache are exact too: nothing cached was corrupted."""
    prompt = [7, 8, 9] + PROMPT * 8  # 67 tokens: 4 full blocks of 16
    short = engine_params(SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))
    expected_short = reference.generate([prompt], short)[0].token_ids
    for w in ("w0", "w1"):
        assert await run_to_end(bus, w, f"warm-{w}", prompt, 8) == expected_short
    stats = Stats()
    await bus.subscribe(worker_stats(), WorkerStats, stats.on)
    stream = await start(bus, "kv-cached-prefix", prompt, None)
    while len(stream.chunks) < 5:
        await asyncio.sleep(0.002)
    moved = await migrate_out(bus, "kv-cached-prefix", "w1")
    assert isinstance(moved, CtlDone) and moved.migration is not None and not moved.migration.fallback, moved
    await finished(stream, reference, prompt, None)
    for w in ("w0", "w1"):
        assert await run_to_end(bus, w, f"again-{w}", prompt, 8) == expected_short
    after = time.time()
    while not all(w in stats.latest and stats.latest[w].ts > after for w in ("w0", "w1")):
        await asyncio.sleep(0.02)
    for w in ("w0", "w1"):  # the requests after the warm-up were admitted on cached blocks
        assert sum(i.prefix_hit_blocks for i in stats.latest[w].instances) > 0
