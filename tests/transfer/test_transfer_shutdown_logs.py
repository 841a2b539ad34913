"""An orderly close of the data plane is quiet; a peer that dies still warns.

Closing linked planes (ours, or the peer's in order: its Goodbye) logs "data-plane link
closed" at info, never a warning; a peer killed without closing leaves our link with
"data-plane link down" at warning. Logs are captured from structlog as the code emits them.
"""
from __future__ import annotations

import asyncio
import signal
from typing import Any, Iterator

import numpy as np
import pytest
from structlog.testing import capture_logs

from services.gpu_worker.transfer import DataPlane, DataPlaneConfig, Link, TrafficClass
from transfer_peer import PeerProcess

pytestmark = pytest.mark.timeout(120)

KV = TrafficClass.KV


def link_events(logs: list[dict[str, Any]]) -> list[tuple[str, str, str | None]]:
    return [(e["log_level"], e["event"], e.get("by")) for e in logs if e["event"].startswith("data-plane link")]


async def until_dead(link: Link, timeout: float = 30.0) -> None:
    async def wait() -> None:
        while link.alive:
            await asyncio.sleep(0.02)

    await asyncio.wait_for(wait(), timeout)


def warnings(logs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [e for e in logs if e["log_level"] in ("warning", "error", "critical")]


async def test_closing_two_linked_planes_in_order_logs_no_warning() -> None:
    with capture_logs() as logs:
        a = await DataPlane("a", config=DataPlaneConfig()).start()
        b = await DataPlane("b", config=DataPlaneConfig()).start()
        for kind in TrafficClass:
            for plane in (a, b):
                plane.inbox.on_kind(kind, lambda start, _peer: _sink(start))
        a_to_b = await a.link("b", b.address)
        b_to_a = await b.link("a", a.address)
        await a_to_b.send(np.arange(4096, dtype=np.uint8), kind=KV, key="x", timeout=30)
        await b_to_a.send(np.arange(4096, dtype=np.uint8), kind=KV, key="y", timeout=30)
        await b.close()  # b in order: its own link closes, and a's link to it hears b's Goodbye
        await until_dead(a_to_b)
        await a.close()
    assert warnings(logs) == [], warnings(logs)
    events = link_events(logs)
    assert ("info", "data-plane link closed", "us") in events  # b's own link
    assert ("info", "data-plane link closed", "peer") in events  # a's link, on b's Goodbye


@pytest.fixture
def peer() -> Iterator[PeerProcess]:
    p = PeerProcess()
    yield p
    p.stop()


async def test_a_peer_killed_uncleanly_still_warns(peer: PeerProcess) -> None:
    plane = DataPlane("sender", config=DataPlaneConfig(connect_timeout_s=5))
    try:
        with capture_logs() as logs:
            link = await plane.link("peer", peer.address)
            await link.send(np.arange(4096, dtype=np.uint8), kind=KV, key="before", timeout=30)
            assert (await peer.next_event()).event == "received"
            peer.proc.send_signal(signal.SIGKILL)  # no Goodbye: a crash
            peer.proc.wait(10)
            await until_dead(link)
    finally:
        await plane.close()
    assert ("warning", "data-plane link down", None) in link_events(logs)
    assert not any(e["event"] == "data-plane link closed" and e.get("by") == "peer" for e in logs)


def _sink(start: Any) -> Any:
    from services.gpu_worker.transfer.sink import Sink

    return Sink(start.key, [np.empty(start.total_bytes, dtype=np.uint8)])
