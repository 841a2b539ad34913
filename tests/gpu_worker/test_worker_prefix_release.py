"""EvictPrefixBlocks on a real worker process (registry + gpu_worker over a real nats-server): the memory
economy's `prefix` purchase. A finished request leaves its full prompt blocks cached-free, the stats carry
them (prefix_cached_free_*) and, after a repeat of the prompt hits them, a hit rate; the command the planner
sends for a bought `ReleasePrefixBlocks` frees them, once per idempotency key; the same prompt still gets
the same greedy tokens afterwards (recomputed)."""
from __future__ import annotations

import asyncio
from collections.abc import Iterator

import pytest

from service_procs import eventually
from shared.bus import Bus, BusSettings
from shared.events import AssignAccepted, AssignReply, InstanceStats, TokenChunk, WorkerStats
from shared.events.ctl import CtlDone, CtlRefused, CtlReply, EvictPrefixBlocks
from shared.events.plan import Plan, ReleasePrefixBlocks
from shared.planner.effects import ctl_commands
from shared.subjects import worker_assign, worker_ctl, worker_stats
from worker_harness import INSTANCE, assignment, one_worker, watch

pytestmark = pytest.mark.timeout(120)
PROMPT = [(7 * i + 3) % 500 + 1 for i in range(41)]  # 5 full blocks of 8 tokens (and one token over)


@pytest.fixture(scope="module")
def worker_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    with one_worker(tmp_path_factory.mktemp("prefix-release")) as url:
        yield url


async def _generate(bus: Bus, request_id: str) -> list[int]:
    stream = await watch(bus, request_id)
    reply = await bus.request(worker_assign("w0"), assignment(request_id, PROMPT, max_tokens=4), AssignReply)
    assert isinstance(reply, AssignAccepted), reply
    await stream.wait()
    assert isinstance(stream.final, TokenChunk), stream.final
    return stream.tokens


def _inst(stats: WorkerStats) -> InstanceStats:
    return next(i for i in stats.instances if i.instance_id == INSTANCE)


async def test_a_bought_prefix_release_frees_the_cached_blocks(worker_url: str) -> None:
    bus = await Bus.connect(BusSettings(url=worker_url), service="test")
    seen: list[WorkerStats] = []

    async def on(msg: WorkerStats, _ctx) -> None:  # type: ignore[no-untyped-def]
        seen.append(msg)

    async def latest(check):  # type: ignore[no-untyped-def]
        async def first() -> WorkerStats | None:
            return next((s for s in reversed(seen) if check(_inst(s))), None)
        return await eventually(first, timeout=20)

    sub = await bus.subscribe(worker_stats(), WorkerStats, on)
    try:
        first = await _generate(bus, "p-1")
        assert await _generate(bus, "p-2") == first  # the repeat hits the cached prompt blocks
        cached = _inst(await latest(lambda i: i.prefix_cached_free_blocks > 0 and i.prefix_hit_blocks > 0))
        assert cached.prefix_cached_free_bytes > 0 and cached.prefix_queried_blocks >= cached.prefix_hit_blocks
        held = cached.prefix_cached_free_blocks
        assert cached.prefix_hit_blocks >= 4  # p-2 found p-1's leading blocks

        effect = Plan(plan_id="buy-7", ts=0.0, trigger="kv_pressure",
                      actions=[ReleasePrefixBlocks(worker_id="w0", instance_id=INSTANCE, blocks=held)])
        ((target, cmd),) = ctl_commands(effect)  # what the planner's executor sends for the purchase
        assert target == "w0" and isinstance(cmd, EvictPrefixBlocks)
        done = await bus.request(worker_ctl("w0"), cmd, CtlReply, timeout=30)
        assert isinstance(done, CtlDone) and done.command == "EvictPrefixBlocks", done
        assert done.detail.startswith(f"{held} of {held} cached prefix blocks") and not done.replayed
        after = _inst(await latest(lambda i: i.prefix_cached_free_blocks == 0))
        assert after.prefix_cached_free_bytes == 0

        replay = await bus.request(worker_ctl("w0"), cmd, CtlReply, timeout=30)
        assert isinstance(replay, CtlDone) and replay.replayed and replay.detail == done.detail  # not run twice
        unknown = await bus.request(worker_ctl("w0"), EvictPrefixBlocks(idempotency_key="x-1", instance_id="nope",
                                                                         blocks=1), CtlReply, timeout=30)
        assert isinstance(unknown, CtlRefused) and unknown.code == "not_found"

        assert await _generate(bus, "p-3") == first  # recomputed: the same greedy tokens
        await asyncio.sleep(0)
    finally:
        await sub.unsubscribe()
        await bus.close()
