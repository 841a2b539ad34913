"""Transfers between two processes (two UCX workers) over loopback: integrity, priority, fairness,
cancellation, backpressure. The receiver is a real probe-peer process reporting sha256 digests."""
from __future__ import annotations

import asyncio
import hashlib
from typing import AsyncIterator, Iterator

import numpy as np
import pytest
import torch

from services.gpu_worker.transfer import (
    ChunkingConfig, DataPlane, DataPlaneConfig, TrafficClass, TransferFailed,
)
from transfer_peer import PeerProcess

pytestmark = pytest.mark.timeout(120)

CHUNK = 256 << 10
KV, ACT = TrafficClass.KV, TrafficClass.ACTIVATION


def sha(*buffers: object) -> str:
    h = hashlib.sha256()
    for b in buffers:
        h.update(b)  # type: ignore[arg-type]
    return h.hexdigest()


def random_bytes(n: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8)


@pytest.fixture
def peer() -> Iterator[PeerProcess]:
    p = PeerProcess()
    yield p
    p.stop()


@pytest.fixture
async def plane(request: pytest.FixtureRequest) -> AsyncIterator[DataPlane]:
    overrides = getattr(request, "param", {})
    chunking = ChunkingConfig(min_chunk=CHUNK, max_chunk=CHUNK, **overrides)
    p = DataPlane("sender", config=DataPlaneConfig(chunking=chunking, connect_timeout_s=5))
    yield p
    await p.close()


async def test_bytes_arrive_intact_around_chunk_boundaries(plane: DataPlane, peer: PeerProcess) -> None:
    link = await plane.link("peer", peer.address)
    for i, n in enumerate([0, 1, CHUNK - 1, CHUNK, CHUNK + 1, 3 * CHUNK + 7]):
        data = random_bytes(n, seed=i)
        receipt = await link.send(data, kind=KV, key=f"k{n}", timeout=60)
        event = await peer.next_event()
        assert (event.event, event.key, event.nbytes) == ("received", f"k{n}", n)
        assert event.sha256 == sha(data)
        assert receipt.chunks == event.chunks == max(1, -(-n // CHUNK))
    # one stream from several buffers (odd sizes, a bf16 tensor): chunks span buffer boundaries
    parts = [random_bytes(1000, 7), torch.randn(CHUNK // 2 + 3, dtype=torch.bfloat16), random_bytes(5, 8)]
    receipt = await link.send(parts, kind=TrafficClass.WEIGHTS, key="parts", timeout=60)
    event = await peer.next_event()
    assert event.event == "received" and event.sha256 == sha(parts[0], parts[1].view(torch.uint8).numpy(), parts[2])
    assert receipt.chunks == 2
    assert await plane.link("peer") is link  # connections are reused


@pytest.mark.parametrize("plane", [{"max_in_flight": 2}, {"max_in_flight": 2, "express_activations": False}],
                         indirect=True, ids=["express-lane", "one-lane"])
async def test_activation_preempts_a_bulk_transfer(plane: DataPlane, peer: PeerProcess) -> None:
    """On its own endpoint (express lane) or at the next chunk boundary of the bulk lane."""
    link = await plane.link("peer", peer.address)
    assert (link.express is not None) == plane.config.chunking.express_activations
    kv_data = random_bytes(64 * CHUNK)
    kv = await link.submit(kv_data, kind=KV, key="kv")
    while kv.chunks_sent < 4:
        await asyncio.sleep(0.001)
    act_data = random_bytes(64 << 10, seed=1)
    act = await link.submit(act_data, kind=ACT, key="act")
    receipt = await act.wait(60)
    # nothing new was started ahead of it: it waited only for the chunks already on the wire
    assert receipt.chunks_ahead == 0
    log = list(link.sent_log)
    act_pos = next(i for i, (tid, _, _) in enumerate(log) if tid == act.transfer_id)
    kv_before = sum(1 for tid, _, _ in log[:act_pos] if tid == kv.transfer_id)
    assert kv_before < 64, "the activation went out while the KV transfer still had chunks to send"
    assert not kv.done() or kv_before < 64
    kv_receipt = await kv.wait(60)
    assert kv_receipt.seconds > receipt.seconds
    events = {(await peer.next_event()).key: None for _ in range(2)}
    assert list(events) == ["act", "kv"]  # the receiver completed the activation first


async def test_many_activations_of_any_size_arrive_intact_beside_a_bulk_transfer(plane: DataPlane,
                                                                                  peer: PeerProcess) -> None:
    """More than the express lane's posted receives and in-flight slots, inline and not (over 1 MiB)."""
    link = await plane.link("peer", peer.address)
    kv_data = random_bytes(32 * CHUNK)
    kv = await link.submit(kv_data, kind=KV, key="kv")
    sizes = [0, 1, 4096, 256 << 10, (1 << 20) + 1] + [10_000 + i for i in range(15)]
    sent = {f"act-{i}": random_bytes(n, seed=i + 1) for i, n in enumerate(sizes)}
    handles = [await link.submit(data, kind=ACT, key=key) for key, data in sent.items()]
    receipts = await asyncio.gather(*(h.wait(60) for h in handles))
    assert all(r.chunks == 1 for r in receipts)
    await kv.wait(60)
    events = {e.key: e for e in [await peer.next_event() for _ in range(len(sent) + 1)]}
    assert events["kv"].sha256 == sha(kv_data)
    for key, data in sent.items():
        assert (events[key].event, events[key].nbytes, events[key].sha256) == ("received", data.shape[0], sha(data))


async def test_transfers_of_one_class_share_the_link_round_robin(plane: DataPlane, peer: PeerProcess) -> None:
    link = await plane.link("peer", peer.address)
    a = await link.submit(random_bytes(8 * CHUNK, 1), kind=KV, key="a")
    b = await link.submit(random_bytes(8 * CHUNK, 2), kind=KV, key="b")
    await asyncio.gather(a.wait(60), b.wait(60))
    order = [tid for tid, _, _ in link.sent_log if tid in (a.transfer_id, b.transfer_id)]
    assert order[:16] == [a.transfer_id, b.transfer_id] * 8


async def test_cancel_mid_transfer(plane: DataPlane, peer: PeerProcess) -> None:
    link = await plane.link("peer", peer.address)
    handle = await link.submit(random_bytes(128 * CHUNK), kind=KV, key="doomed")
    while handle.chunks_sent < 2:
        await asyncio.sleep(0.001)
    assert handle.cancel()
    with pytest.raises(TransferFailed) as info:
        await handle
    assert info.value.reason == "cancelled"
    event = await peer.next_event()
    assert (event.event, event.key, event.reason) == ("failed", "doomed", "cancelled")
    sent = sum(1 for tid, _, _ in link.sent_log if tid == handle.transfer_id)
    assert sent < 128
    data = random_bytes(3 * CHUNK, 3)  # the link goes on
    await link.send(data, kind=KV, key="after", timeout=60)
    event = await peer.next_event()
    assert event.key == "after" and event.sha256 == sha(data)


@pytest.mark.parametrize("plane", [{"queue_bound_bytes": 4 * CHUNK}], indirect=True)
async def test_submit_waits_while_the_class_queue_is_over_its_bound(plane: DataPlane, peer: PeerProcess) -> None:
    link = await plane.link("peer", peer.address)
    bound = 4 * CHUNK
    first = await link.submit(random_bytes(3 * CHUNK, 1), kind=KV, key="first")
    assert link.schedule.queued_bytes(KV) == 3 * CHUNK  # admitted at once: the queue was empty
    second = await link.submit(random_bytes(3 * CHUNK, 2), kind=KV, key="second")  # 6 > 4 chunks: waits
    assert link.backpressure_waits >= 1
    assert link.schedule.queued_bytes(KV) <= bound
    activation = await link.submit(random_bytes(CHUNK, 3), kind=ACT, key="act")  # its own bound: no wait
    await asyncio.gather(first.wait(60), second.wait(60), activation.wait(60))
    keys = {(await peer.next_event()).key for _ in range(3)}
    assert keys == {"first", "second", "act"}
