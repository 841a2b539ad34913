"""PrefixSummary from a real worker process (registry + gpu_worker over a real nats-server): after a request,
the instance's summary names its prompt's full blocks by the hashes the dispatcher computes for the same
prompt (shared/prefix_hash.py under the catalog model name); a repeat of the prompt shows
up as hit blocks in the next summary."""
from __future__ import annotations

from collections.abc import Iterator

import pytest

from service_procs import eventually
from shared.bus import Bus, BusSettings
from shared.events import AssignAccepted, AssignReply, PrefixSummary, TokenChunk
from shared.prefix_hash import block_hashes, prefix_salt
from shared.subjects import worker_assign, worker_prefixes
from worker_harness import INSTANCE, MODEL, assignment, one_worker, watch

pytestmark = pytest.mark.timeout(120)
BS = 8  # the harness's kv_block_tokens
PROMPT = [(11 * i + 5) % 500 + 1 for i in range(43)]  # 5 full blocks and 3 tokens over


@pytest.fixture(scope="module")
def worker_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    with one_worker(tmp_path_factory.mktemp("prefix-summary")) as url:
        yield url


async def _generate(bus: Bus, request_id: str) -> None:
    stream = await watch(bus, request_id)
    reply = await bus.request(worker_assign("w0"), assignment(request_id, PROMPT, max_tokens=2), AssignReply)
    assert isinstance(reply, AssignAccepted), reply
    await stream.wait()
    assert isinstance(stream.final, TokenChunk), stream.final


async def test_a_worker_publishes_the_prefixes_it_holds(worker_url: str) -> None:
    bus = await Bus.connect(BusSettings(url=worker_url), service="test")
    seen: list[PrefixSummary] = []

    async def on(msg: PrefixSummary, _ctx) -> None:  # type: ignore[no-untyped-def]
        if msg.instance_id == INSTANCE:
            seen.append(msg)

    expected = block_hashes(PROMPT, BS, prefix_salt(MODEL, None))
    try:
        await bus.subscribe(worker_prefixes(), PrefixSummary, on)
        async def heard() -> bool:
            return bool(seen)

        await eventually(heard, timeout=10.0)  # an empty one first, then every 2 s while unchanged
        assert seen[0].worker_id == "w0" and seen[0].model == MODEL and seen[0].block_size == BS

        await _generate(bus, "first")

        async def holds() -> bool:
            return bool(seen) and set(expected) <= set(seen[-1].hashes)

        await eventually(holds, timeout=10.0)
        last = seen[-1]
        assert last.held_blocks >= len(expected) and last.hit_blocks == 0
        assert [m.seq for m in seen] == sorted(m.seq for m in seen)

        await _generate(bus, "again")

        async def hit() -> bool:
            return bool(seen) and seen[-1].hit_blocks >= len(expected)

        await eventually(hit, timeout=10.0)
        assert seen[-1].queried_blocks >= 2 * len(expected)
    finally:
        await bus.close()

