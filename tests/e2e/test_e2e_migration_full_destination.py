"""A KV migration into a destination whose KV is full, live: two gpu_worker processes with tight pools, no
planner (the test sends the MigrateOut itself, as the planner would). The move is refused at the destination's
reservation (`insufficient_memory`): the request never stops on its source and its stream completes unmoved,
token-exact. (The planner's own pressure moves: test_e2e_planner_pressure.py, on larger pools.)"""
from __future__ import annotations

import random

import pytest

from e2e.assets import BLOCK_TOKENS, LLAMA, MAX_CONTEXT, Oracle
from e2e.cluster import ClusterSpec, E2ECluster
from e2e.observer import Observer
from e2e.pressure_streams import assert_exact, finished, kv_tokens, submit
from shared.bus import Bus, BusSettings
from shared.events import SamplingParams
from shared.events.ctl import CtlRefused, CtlReply, MigrateOut
from shared.subjects import worker_ctl

pytestmark = pytest.mark.timeout(300)

# 4 MiB pools: 2,008 KV tokens, so a request of 0.35 of a pool leaves room under the model's context
# (MAX_CONTEXT) for ~285 tokens of decode, the time the destination stays full
CLUSTER_SPEC = ClusterSpec(workers={"w0": [LLAMA], "w1": [LLAMA]}, gateway=False, migration="kv", worker_memory="4MiB",
                           policies_toml="buddy_groups = false\nprewarm = false")


@pytest.fixture
async def bus(cluster: E2ECluster):  # type: ignore[no-untyped-def]
    bus = await Bus.connect(BusSettings(url=cluster.nats_url), service="cli")
    yield bus
    await bus.close()


async def test_a_migration_into_a_full_destination_is_refused_and_the_request_goes_on(
        bus: Bus, observer: Observer, oracle: Oracle) -> None:
    await observer.wait_for(lambda: {s.worker_id for _at, s in observer.stats} >= {"w0", "w1"}, timeout=10)
    capacity, _ = kv_tokens(observer, "w0")
    # as long as two of them can be and still fit a worker: the destination stays full as long as it can
    prompt = int(0.35 * capacity)
    max_tokens = min(MAX_CONTEXT - prompt - 8, (capacity - 1) // 2 - prompt - BLOCK_TOKENS)
    # two requests fit one worker; what they leave free is less than a third's KV at any point of its run
    assert 2 * (prompt + max_tokens) < capacity and capacity - 2 * (prompt + max_tokens) < prompt, capacity
    rng = random.Random(11)
    greedy = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    # the destination is full only while its two requests run; on a busy box one worker process can get far
    # more CPU than the other and finish them (or the mover) before the MigrateOut lands: then the premise
    # is gone (the move rightly succeeds, or is refused not_found) and the three run again with fresh ids
    # (at most 3 times)
    for attempt in range(3):
        load = {f"full{attempt}-{i}": [rng.randrange(16, 256) for _ in range(prompt)] for i in range(3)}
        for rid, ids in load.items():
            await submit(bus, rid, ids, greedy)
        await observer.wait_for(lambda: all(len(observer.chunks(r)) >= 2 for r in load), timeout=60)
        where = {rid: observer.workers(rid)[0] for rid in load}
        counts = {w: [r for r in load if where[r] == w] for w in ("w0", "w1")}
        (source,) = [w for w, rids in counts.items() if len(rids) == 1] or [None]
        assert source is not None, f"least load did not split three requests two and one: {where}"
        destination = "w1" if source == "w0" else "w0"
        (rid,) = counts[source]
        _, instance = kv_tokens(observer, destination)
        reply = await bus.request(worker_ctl(source), MigrateOut(
            idempotency_key=f"full-{rid}", request_id=rid, destination=destination, destination_instance=instance,
            mode="kv"), CtlReply, timeout=60)
        still_full = not any(c.final for r in counts[destination] for c in observer.chunks(r))
        await finished(observer, list(load))
        for r, ids in load.items():
            assert_exact(observer, oracle, r, ids, greedy)
        if isinstance(reply, CtlRefused) and reply.code == "not_found":
            continue  # the mover itself ended before the move (its refusal is right; not this premise)
        if still_full or isinstance(reply, CtlRefused):
            break
    assert isinstance(reply, CtlRefused) and reply.code == "insufficient_memory", reply
    assert observer.workers(rid) == [source], "the refused request moved"
