"""Failures are typed and nothing hangs: corruption, a peer dying mid-transfer, no peer, no destination."""
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
KV = TrafficClass.KV


def random_bytes(n: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8)


def config() -> DataPlaneConfig:
    return DataPlaneConfig(chunking=ChunkingConfig(min_chunk=CHUNK, max_chunk=CHUNK), connect_timeout_s=5)


@pytest.fixture
async def plane() -> AsyncIterator[DataPlane]:
    p = DataPlane("sender", config=config())
    yield p
    await p.close()


@pytest.fixture
def corrupting_peer() -> Iterator[PeerProcess]:
    p = PeerProcess("--corrupt-chunk", "2")  # flips a byte of the 3rd payload it receives
    yield p
    p.stop()


@pytest.fixture
def dying_peer() -> Iterator[PeerProcess]:
    p = PeerProcess("--exit-after-chunks", "3")
    yield p
    p.stop()


async def test_corrupted_chunk_fails_the_transfer_with_a_typed_reason(plane: DataPlane,
                                                                       corrupting_peer: PeerProcess) -> None:
    link = await plane.link("peer", corrupting_peer.address)
    with pytest.raises(TransferFailed) as info:
        await link.send(random_bytes(8 * CHUNK), kind=KV, key="kv", timeout=60)
    assert info.value.reason == "corrupt" and info.value.peer == "peer"
    event = await corrupting_peer.next_event()
    assert (event.event, event.key, event.reason) == ("failed", "kv", "corrupt")
    data = random_bytes(2 * CHUNK, 1)  # the link survives: the next transfer is intact
    await link.send(data, kind=KV, key="next", timeout=60)
    event = await corrupting_peer.next_event()
    assert event.event == "received" and event.sha256 == hashlib.sha256(data).hexdigest()


@pytest.fixture
def corrupting_first_peer() -> Iterator[PeerProcess]:
    p = PeerProcess("--corrupt-chunk", "0")
    yield p
    p.stop()


async def test_corrupted_activation_on_the_express_lane_is_detected(plane: DataPlane,
                                                                    corrupting_first_peer: PeerProcess) -> None:
    link = await plane.link("peer", corrupting_first_peer.address)
    assert link.express is not None
    with pytest.raises(TransferFailed) as info:
        await link.send(random_bytes(64 << 10), kind=TrafficClass.ACTIVATION, key="act", timeout=60)
    assert info.value.reason == "corrupt"
    event = await corrupting_first_peer.next_event()
    assert (event.event, event.key, event.reason) == ("failed", "act", "corrupt")
    data = random_bytes(1000, 1)  # the lane survives
    await link.send(data, kind=TrafficClass.ACTIVATION, key="next", timeout=60)
    event = await corrupting_first_peer.next_event()
    assert event.event == "received" and event.sha256 == hashlib.sha256(data).hexdigest()


async def test_peer_death_mid_transfer_fails_the_sender_without_hanging(plane: DataPlane,
                                                                        dying_peer: PeerProcess) -> None:
    link = await plane.link("peer", dying_peer.address)
    queued = await link.submit(random_bytes(CHUNK, 1), kind=TrafficClass.WEIGHTS, key="queued")
    running = await link.submit(random_bytes(64 * CHUNK), kind=KV, key="kv")
    for handle in (running, queued):
        with pytest.raises(TransferFailed) as info:
            await asyncio.wait_for(handle.wait(), 60)
        assert info.value.reason == "peer_lost"
    assert not link.alive
    dying_peer.proc.wait(10)
    with pytest.raises(TransferFailed) as info:  # a new link finds nobody listening
        await plane.link("peer", dying_peer.address)
    assert info.value.reason == "unreachable"


async def test_unknown_peer_is_unreachable(plane: DataPlane) -> None:
    with pytest.raises(TransferFailed) as info:
        await plane.link("nobody")  # no resolver, no address
    assert info.value.reason == "unreachable"
    resolving = DataPlane("sender-2", config=config(), resolver=lambda _peer: _none())
    with pytest.raises(TransferFailed) as info:
        await resolving.link("ghost")
    assert info.value.reason == "unreachable"
    await resolving.close()


async def _none() -> None:
    return None


async def test_expected_destination_receives_in_place_and_unexpected_keys_are_rejected() -> None:
    """Two planes in one process (one UCX worker): the receiver preallocates the destination."""
    receiver = await DataPlane("receiver", config=config()).start()
    sender = DataPlane("sender", config=config(), resolver=lambda _p: _address(receiver))
    try:
        dest = torch.zeros(3 * CHUNK // 4 + 5, dtype=torch.float32)  # not a multiple of the chunk
        sink = receiver.inbox.expect("kv:req-1", dest)
        src = torch.randn_like(dest)
        link = await sender.link("receiver")
        receipt = await link.send(src, kind=KV, key="kv:req-1", request_id="req-1", timeout=60)
        received = await sink.wait(10)
        assert torch.equal(dest, src) and received.buffers is dest  # landed in the preallocated tensor
        assert (received.peer, received.request_id, received.chunks) == ("sender", "req-1", receipt.chunks)
        with pytest.raises(TransferFailed) as info:
            await link.send(random_bytes(100), kind=KV, key="nobody-expects-this", timeout=60)
        assert info.value.reason == "rejected"
        small = receiver.inbox.expect("too-small", np.zeros(10, np.uint8))
        with pytest.raises(TransferFailed) as info:
            await link.send(random_bytes(100), kind=KV, key="too-small", timeout=60)
        assert info.value.reason == "rejected"
        with pytest.raises(TransferFailed):
            await small.wait(10)
        with pytest.raises(TransferFailed) as info:  # the express lane's inline path refuses the same way
            await link.send(b"x" * 100, kind=TrafficClass.ACTIVATION, key="too-small", timeout=60)
        assert info.value.reason == "rejected"
        with pytest.raises(TransferFailed) as info:
            await link.send(b"x", kind=TrafficClass.ACTIVATION, key="unexpected", timeout=60)
        assert info.value.reason == "rejected"
        hidden = receiver.inbox.expect("stage-0", np.zeros(64, np.uint8))
        await link.send(np.arange(64, dtype=np.uint8), kind=TrafficClass.ACTIVATION, key="stage-0", timeout=60)
        assert np.array_equal((await hidden.wait(10)).buffers, np.arange(64, dtype=np.uint8))
        activations = receiver.inbox.accept_any(TrafficClass.ACTIVATION)  # fresh memory per transfer
        await link.send(b"hidden-state", kind=TrafficClass.ACTIVATION, key="stage-1", timeout=60)
        got = await asyncio.wait_for(activations.get(), 10)
        assert bytes(got.buffers) == b"hidden-state" and got.kind is TrafficClass.ACTIVATION
    finally:
        await sender.close()
        await receiver.close()


async def _address(plane: DataPlane) -> str:
    return plane.address
