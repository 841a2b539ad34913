"""OffloadAdapter on a real worker process (registry + gpu_worker over a real nats-server): the memory
economy's "evict a cold adapter" frees only the device copy. The adapter stays registered, a new
request naming it reloads it and gets the same greedy tokens; one in use is refused `busy`."""
from __future__ import annotations

import asyncio
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from service_procs import eventually, local_cluster
from services.gpu_worker.engine.checkpoint_gen import make_lora
from shared.bus import Bus, BusSettings
from shared.events import AssignAccepted, AssignReply, TokenChunk, WorkerStats
from shared.events.ctl import CtlDone, CtlRefused, CtlReply, LoadAdapter, OffloadAdapter
from shared.subjects import worker_assign, worker_ctl, worker_stats
from worker_harness import ADAPTER, assignment, make_assets, watch

pytestmark = pytest.mark.timeout(120)
ONE = 2 * (4 * (64 + 64) + 4 * (64 + 32)) * 4  # bytes of a rank-4 q,v adapter of the 2-layer tiny model
NAME = "cold-x"
PROMPT = [1, 5, 6, 7, 9]


@dataclass
class Worker:
    url: str
    directory: Path


@pytest.fixture(scope="module")
def worker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Worker]:
    directory = tmp_path_factory.mktemp("offload")
    config = make_assets(directory)
    for name, seed in ((NAME, 21), ("pin-y", 22)):
        make_lora(directory / name, directory / "tiny", rank=4, targets=["q", "v"], seed=seed)
    with local_cluster(directory) as services:
        services.start("registry", config, "registry-t")
        services.start("gpu_worker", config, "worker-w0", "--worker-id", "w0", "--threads", "1")
        services.wait_ready(timeout=60)
        yield Worker(services.url, directory)


class StatsLog:
    def __init__(self) -> None:
        self.seen: list[WorkerStats] = []

    async def on(self, msg: WorkerStats, _ctx) -> None:  # type: ignore[no-untyped-def]
        self.seen.append(msg)

    async def wait(self, check, timeout: float = 10.0) -> WorkerStats:  # type: ignore[no-untyped-def]
        async def first() -> WorkerStats | None:
            return next((s for s in reversed(self.seen) if check(s)), None)

        return await eventually(first, timeout=timeout)  # type: ignore[no-any-return]


def levels(stats: WorkerStats, name: str) -> set[str]:
    return {r.level for r in stats.adapter_residency if r.adapter == name}


def registered(stats: WorkerStats) -> set[str]:
    return {a for i in stats.instances for a in i.adapters}


async def ctl(bus: Bus, msg: LoadAdapter | OffloadAdapter) -> CtlReply:
    return await bus.request(worker_ctl("w0"), msg, CtlReply, timeout=30)  # type: ignore[no-any-return]


async def generate(bus: Bus, request_id: str, max_tokens: int = 24) -> list[int]:
    stream = await watch(bus, request_id)
    reply = await bus.request(worker_assign("w0"), assignment(request_id, PROMPT, adapter=NAME, max_tokens=max_tokens),
                              AssignReply)
    assert isinstance(reply, AssignAccepted), reply
    await stream.wait()
    assert isinstance(stream.final, TokenChunk) and stream.final.finish_reason == "length", stream.final
    return stream.tokens


async def test_offload_frees_the_device_copy_and_the_adapter_stays_servable(worker: Worker) -> None:
    bus = await Bus.connect(BusSettings(url=worker.url), service="test")
    log = StatsLog()
    sub = await bus.subscribe(worker_stats(), WorkerStats, log.on)
    try:
        loaded = await ctl(bus, LoadAdapter(idempotency_key="load-x", adapter=NAME, base="tiny",
                                            path=str(worker.directory / NAME)))
        assert isinstance(loaded, CtlDone), loaded
        before = await generate(bus, "used-1")
        assert len(before) == 24
        resident = await log.wait(lambda s: "device" in levels(s, NAME))  # used: on the device now

        seen_before = len(log.seen)
        offloaded = await ctl(bus, OffloadAdapter(idempotency_key="off-1", adapter=NAME, plan_id="arb-1"))
        assert isinstance(offloaded, CtlDone) and offloaded.command == "OffloadAdapter", offloaded
        assert f"{ONE} device bytes freed" in offloaded.detail
        await asyncio.sleep(0.05)  # the stats published before the reply are in by now (same connection, in order)
        after = next((s for s in log.seen[seen_before:] if "device" not in levels(s, NAME)), None)
        assert after is not None, "no WorkerStats published at once after the offload"
        assert after.pool.adapter_bytes == resident.pool.adapter_bytes - ONE
        assert levels(after, NAME) == {"host"}  # its host copy stays
        assert NAME in registered(after) and ADAPTER in registered(after)  # still routable here

        again = await ctl(bus, OffloadAdapter(idempotency_key="off-2", adapter=NAME))
        assert isinstance(again, CtlDone) and "not resident" in again.detail and not again.replayed
        replay = await ctl(bus, OffloadAdapter(idempotency_key="off-1", adapter=NAME, plan_id="arb-1"))
        assert isinstance(replay, CtlDone) and replay.replayed and replay.detail == offloaded.detail

        # a new request naming it is served: it reloads, with the same weights (same greedy tokens)
        assert await generate(bus, "used-2") == before
        await log.wait(lambda s: "device" in levels(s, NAME))

        unknown = await ctl(bus, OffloadAdapter(idempotency_key="off-3", adapter="no-such"))
        assert isinstance(unknown, CtlRefused) and unknown.code == "not_found" and "no-such" in unknown.message
    finally:
        await sub.unsubscribe()
        await bus.close()


async def test_offload_of_an_adapter_in_use_or_pinned_is_refused(worker: Worker) -> None:
    bus = await Bus.connect(BusSettings(url=worker.url), service="test")
    try:
        loaded = await ctl(bus, LoadAdapter(idempotency_key="load-x-2", adapter=NAME, base="tiny",
                                            path=str(worker.directory / NAME)))
        assert isinstance(loaded, CtlDone), loaded
        stream = await watch(bus, "long")
        reply = await bus.request(worker_assign("w0"), assignment("long", PROMPT, adapter=NAME, max_tokens=500),
                                  AssignReply)
        assert isinstance(reply, AssignAccepted)
        await eventually(lambda: _true_if(bool(stream.tokens)), timeout=30)  # it runs
        busy = await ctl(bus, OffloadAdapter(idempotency_key="off-busy", adapter=NAME))
        assert not stream.done.is_set(), "the request ended before the offload: make it longer"
        assert isinstance(busy, CtlRefused) and busy.code == "busy" and "long" in busy.message, busy
        await stream.wait()
        assert isinstance(stream.final, TokenChunk) and len(stream.tokens) == 500  # not cut
        done = await ctl(bus, OffloadAdapter(idempotency_key="off-after", adapter=NAME))
        assert isinstance(done, CtlDone) and f"{ONE} device bytes freed" in done.detail  # cold now: it goes

        pinned = await ctl(bus, LoadAdapter(idempotency_key="load-pin", adapter="pin-y", base="tiny",
                                            path=str(worker.directory / "pin-y"), pinned=True))
        assert isinstance(pinned, CtlDone), pinned
        refused = await ctl(bus, OffloadAdapter(idempotency_key="off-pin", adapter="pin-y"))
        assert isinstance(refused, CtlRefused) and refused.code == "invalid" and "pinned" in refused.message
    finally:
        await bus.close()


async def _true_if(value: bool) -> bool | None:
    return True if value else None
