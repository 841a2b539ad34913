"""Re-dispatch on worker death at the bus level: real NATS, registry, two dispatchers (a queue
group) and two real gpu_worker processes; the test speaks the gateway's protocol (subscribe
to the out subject, then SubmitRequest). Unlike the HTTP suite, nothing here drops duplicate
seqs, so the stream the workers publish must itself have every seq exactly once — which also
shows that each dispatcher re-dispatched only the requests it owns."""
from __future__ import annotations

import asyncio
import time
import uuid

import pytest

from e2e.assets import LLAMA, Oracle, make_assets
from e2e.cluster import ClusterSpec, E2ECluster, WorkerProcess
from shared.bus import Bus, BusSettings, Delivery
from shared.events import SamplingParams, StreamMessage, SubmitAccepted, SubmitReply, SubmitRequest, TokenChunk
from shared.subjects import dispatch_submit, request_out

pytestmark = pytest.mark.timeout(240)

SPEC = ClusterSpec(workers={"w0": [LLAMA], "w1": [LLAMA]}, max_batch=8, gateway=False, dispatchers=2)
STREAMS = 8  # submits spread over the two dispatchers (each sees only its own between stats)
LONG = 320


@pytest.fixture(scope="module")
def live(tmp_path_factory: pytest.TempPathFactory):
    assets = make_assets(tmp_path_factory.mktemp("tiny-models"))
    cluster = E2ECluster(tmp_path_factory.mktemp("cluster"), SPEC, assets).start()
    try:
        yield cluster, Oracle(assets)
    finally:
        cluster.stop()


class Client:
    """What the gateway does on the bus, minus HTTP: subscribe first, then submit."""

    def __init__(self, bus: Bus) -> None:
        self.bus = bus
        self.seen: dict[str, list[StreamMessage]] = {}

    async def submit(self, prompt_ids: list[int], max_tokens: int) -> tuple[str, SubmitReply]:
        rid = f"t-{uuid.uuid4().hex[:12]}"
        self.seen[rid] = []

        async def on_out(msg: StreamMessage, _ctx: Delivery) -> None:
            self.seen[rid].append(msg)

        await self.bus.subscribe(request_out(rid), StreamMessage, on_out)
        msg = SubmitRequest(request_id=rid, model=LLAMA, prompt_token_ids=prompt_ids, arrival_ts=time.time(),
                            sampling=SamplingParams(max_tokens=max_tokens, temperature=0.0))
        return rid, await self.bus.request(dispatch_submit(), msg, SubmitReply, timeout=5.0)

    def chunks(self, rid: str) -> list[TokenChunk]:
        return [m for m in self.seen[rid] if isinstance(m, TokenChunk)]

    def done(self, rid: str) -> bool:
        return any(m.final for m in self.seen[rid])


async def until(check, timeout: float) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, "condition not met in time"
        await asyncio.sleep(0.01)


async def test_killed_workers_streams_continue_elsewhere_with_every_seq_once(live) -> None:  # type: ignore[no-untyped-def]
    cluster, oracle = live
    prompts = await asyncio.to_thread(oracle.long_prompts, LLAMA, STREAMS, LONG)
    bus = await Bus.connect(BusSettings(url=cluster.nats_url), service="gateway")
    try:
        client = Client(bus)
        rids = []
        for prompt in prompts:
            rid, reply = await client.submit(oracle.prompt_ids(LLAMA, prompt), LONG)
            assert isinstance(reply, SubmitAccepted) and reply.worker_id in ("w0", "w1"), reply
            rids.append(rid)
        await until(lambda: all(len(client.chunks(r)) >= 5 for r in rids), 30)
        victim = client.chunks(rids[0])[0].worker_id
        assert victim is not None
        cluster.kill(victim)
        finished_before = {r for r in rids if client.done(r)}  # two dispatchers may overfill a worker
        await until(lambda: all(client.done(r) for r in rids), 90)
        moved = 0
        await until(lambda: not any(p.proc is not None and p.proc.poll() is not None
                                    for n, p in cluster.procs.items() if n.startswith("dispatcher")), 1)
        for rid, prompt in zip(rids, prompts):
            want = oracle.greedy(LLAMA, prompt=prompt, max_tokens=LONG)
            chunks = client.chunks(rid)
            assert sorted(c.seq for c in chunks) == list(range(len(chunks))), "a seq is missing or repeated"
            tokens = [t for c in sorted(chunks, key=lambda c: c.seq) for t in c.token_ids]
            assert tokens == list(want.token_ids)
            final = chunks[-1]
            assert final.finish_reason == "length" and final.usage is not None
            assert final.usage.completion_tokens == LONG and final.usage.prompt_tokens == want.prompt_tokens
            workers = [c.worker_id for c in sorted(chunks, key=lambda c: c.seq)]
            if workers[0] == victim and rid not in finished_before:
                assert workers[-1] != victim  # finished elsewhere
                moved += 1
        assert moved >= 1
        # the dead worker comes back (a new process, same id): it takes assignments again
        cluster.procs[victim] = WorkerProcess("gpu_worker", cluster.nats_url, cluster.config,
                                              f"gpu_worker-{victim}-e2e-r1", "--worker-id", victim).start()
        placed: set[str] = set()
        deadline = time.monotonic() + 60
        while victim not in placed:
            assert time.monotonic() < deadline, f"{victim} never served again\n{cluster.logs()}"
            pair = [await client.submit(oracle.prompt_ids(LLAMA, "hello"), 4) for _ in range(2)]
            placed |= {r.worker_id for _rid, r in pair if isinstance(r, SubmitAccepted) and r.worker_id}
            await asyncio.sleep(0.3)
    finally:
        await bus.close()
