"""`/v1/models` shows where each adapter is warm, from the workers' stats (real gateway stack)."""
from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from services.gateway.residency import ResidencyTable
from shared.bus import Bus, BusSettings
from shared.events import PoolBreakdown, WorkerState, WorkerStats
from shared.events.worker import AdapterResidency
from shared.subjects import worker_stats
from gateway.stack import ADAPTER, MODEL, GatewayStack

pytestmark = pytest.mark.timeout(120)


def stats(worker: str, *rows: tuple[str, str, bool]) -> WorkerStats:
    return WorkerStats(worker_id=worker, seq=1, ts=time.time(), device="cpu", state=WorkerState.READY,
                       pool=PoolBreakdown(capacity_bytes=1 << 20),
                       adapter_residency=[AdapterResidency(adapter=a, level=lvl, pinned=p, rank=4, bytes=100)  # type: ignore[arg-type]
                                          for a, lvl, p in rows])


def test_table_merges_workers_and_forgets_silent_ones() -> None:
    table = ResidencyTable(stale_s=5.0)
    table.update(stats("w1", ("a", "device", True), ("a", "host", True), ("b", "host", False)), now=100.0)
    table.update(stats("w0", ("a", "host", False)), now=103.0)
    cards = table.cards(now=104.0)
    assert (cards["a"].device, cards["a"].host, cards["a"].pinned) == (["w1"], ["w0", "w1"], ["w1"])
    assert cards["b"].host == ["w1"] and cards["b"].device == []
    assert table.cards(now=106.0)["a"].host == ["w0"] and "b" not in table.cards(now=106.0)


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory, tokenizer_dir: Path) -> Iterator[GatewayStack]:
    running = GatewayStack(tmp_path_factory.mktemp("gw-residency"), tokenizer_dir, dispatcher=False).start()
    try:
        yield running
    finally:
        running.stop()


def test_models_list_adapter_residency(stack: GatewayStack) -> None:
    def card() -> dict:  # type: ignore[type-arg]
        body = httpx.get(stack.url + "/v1/models", timeout=5).json()
        return next(m for m in body["data"] if m["id"] == ADAPTER)

    listed = card()
    assert listed["parent"] == MODEL and listed["residency"] == {"device": [], "host": [], "pinned": []}
    base = next(m for m in httpx.get(stack.url + "/v1/models").json()["data"] if m["id"] == MODEL)
    assert base["residency"] is None

    async def publish() -> None:  # what a gpu_worker publishes every stats interval
        bus = await Bus.connect(BusSettings(url=stack.nats_url), service="gpu_worker")
        try:
            await bus.publish(worker_stats(), stats("w7", (ADAPTER, "device", True), (ADAPTER, "host", True)))
            await bus.publish(worker_stats(), stats("w3", (ADAPTER, "host", False)))
        finally:
            await bus.close()

    stack.run(publish())
    stack.wait_http(lambda r: r.status_code == 200 and card()["residency"]["host"] == ["w3", "w7"], "/v1/models")
    assert card()["residency"] == {"device": ["w7"], "host": ["w3", "w7"], "pinned": ["w7"]}
