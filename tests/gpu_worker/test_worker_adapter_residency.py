"""Adapter residency on a real worker process: pinned loads, the bounded host repository, the
ranks of the batch in WorkerStats, and the per-adapter residency metric on /metrics."""
from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from service_procs import eventually, local_cluster
from services.gpu_worker.engine.checkpoint_gen import make_lora
from shared.bus import Bus, BusSettings
from shared.events import AssignAccepted, AssignReply, WorkerStats
from shared.events.ctl import CtlDone, CtlRefused, CtlReply, LoadAdapter
from shared.subjects import worker_assign, worker_ctl, worker_stats
from worker_harness import ADAPTER, make_assets, assignment, watch

pytestmark = pytest.mark.timeout(120)
ONE = 2 * (4 * (64 + 64) + 4 * (64 + 32)) * 4  # bytes of a rank-4 q,v adapter of the 2-layer tiny model


@dataclass
class Worker:
    url: str
    metrics_port: int
    directory: Path


@pytest.fixture(scope="module")
def worker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Worker]:
    directory = tmp_path_factory.mktemp("residency")
    config = make_assets(directory)
    text = config.read_text().replace('stream_interval = "20ms"', f'stream_interval = "20ms"\nlora_host_memory = {2 * ONE}')
    config.write_text(text)
    for name in ("pin-a", "cold-b", "cold-c"):
        make_lora(directory / name, directory / "tiny", rank=4, targets=["q", "v"], seed=len(name))
    with local_cluster(directory) as services:
        services.start("registry", config, "registry-t")
        services.start("gpu_worker", config, "worker-w0", "--worker-id", "w0", "--threads", "1", "--metrics-port", "0")
        health = services.wait_ready(timeout=60)
        yield Worker(services.url, health[1].metrics_port, directory)  # type: ignore[arg-type]


async def next_stats(bus: Bus, check) -> WorkerStats:  # type: ignore[no-untyped-def]
    seen: list[WorkerStats] = []

    async def on(msg: WorkerStats, _ctx) -> None:  # type: ignore[no-untyped-def]
        seen.append(msg)

    sub = await bus.subscribe(worker_stats(), WorkerStats, on)
    try:
        return await eventually(lambda: _first(seen, check), timeout=10)
    finally:
        await sub.unsubscribe()


async def _first(seen: list[WorkerStats], check) -> WorkerStats | None:  # type: ignore[no-untyped-def]
    return next((s for s in reversed(seen) if check(s)), None)


def rows(stats: WorkerStats) -> set[tuple[str, str, bool]]:
    return {(r.adapter, r.level, r.pinned) for r in stats.adapter_residency}


async def load(bus: Bus, directory: Path, name: str, pinned: bool = False) -> CtlReply:
    return await bus.request(worker_ctl("w0"), LoadAdapter(idempotency_key=f"load-{name}", adapter=name, base="tiny",
                                                            path=str(directory / name), pinned=pinned), CtlReply)


async def test_residency_in_stats_and_metrics(worker: Worker) -> None:
    bus = await Bus.connect(BusSettings(url=worker.url), service="test")
    try:
        first = await next_stats(bus, lambda s: bool(s.adapter_residency))
        assert (ADAPTER, "device", False) in rows(first)  # made resident at start (worker.adapters)
        assert first.instances[0].adapter_room_bytes is not None

        reply = await load(bus, worker.directory, "pin-a", pinned=True)
        assert isinstance(reply, CtlDone) and "pinned" in reply.detail
        for name in ("cold-b", "cold-c"):
            assert isinstance(await load(bus, worker.directory, name), CtlDone)
        stats = await next_stats(bus, lambda s: ("pin-a", "device", True) in rows(s))
        host = [r for r in stats.adapter_residency if r.level == "host"]
        assert sum(r.bytes for r in host) <= 2 * ONE  # the host repository's bound: the rest were spilled
        assert {r.adapter for r in host} == {"cold-b", "cold-c"}  # the two most recently registered
        assert set(stats.instances[0].adapters) == {ADAPTER, "pin-a", "cold-b", "cold-c"}  # all still served

        # a long request with the rank-4 adapter: its rank shows in the batch while it runs
        seen: list[WorkerStats] = []

        async def on(msg: WorkerStats, _ctx) -> None:  # type: ignore[no-untyped-def]
            seen.append(msg)

        sub = await bus.subscribe(worker_stats(), WorkerStats, on)
        stream = await watch(bus, "ranked")
        reply = await bus.request(worker_assign("w0"), assignment("ranked", [1, 5, 6, 7], adapter="cold-b",
                                                                  max_tokens=500), AssignReply)
        assert isinstance(reply, AssignAccepted)
        await stream.wait()
        await sub.unsubscribe()
        busy = [s for s in seen if s.instances[0].running_ranks]
        assert busy and all(s.instances[0].running_ranks == [4] for s in busy)  # 500 tokens outlast a stats interval
        assert ("cold-b", "device", False) in rows(busy[-1])  # used: on the device now

        async with httpx.AsyncClient() as http:
            text = (await http.get(f"http://127.0.0.1:{worker.metrics_port}/metrics")).text
        series = [line for line in text.splitlines() if line.startswith("tidal_worker_adapter_resident_bytes{")]
        assert any('adapter="pin-a"' in s and 'level="device"' in s and 'pinned="true"' in s for s in series), series
        assert any('adapter="cold-c"' in s and 'level="host"' in s and 'pinned="false"' in s for s in series)
        assert not any('adapter="pin-a"' in s and 'level="host"' in s for s in series)  # spilled from host
    finally:
        await bus.close()


async def test_pinning_beyond_the_device_is_refused(worker: Worker) -> None:
    bus = await Bus.connect(BusSettings(url=worker.url), service="test")
    try:
        reply = await bus.request(worker_ctl("w0"), LoadAdapter(idempotency_key="load-missing", adapter="nope",
                                                                base="tiny", path=str(worker.directory / "missing"),
                                                                pinned=True), CtlReply)
        assert isinstance(reply, CtlRefused) and reply.code == "invalid"
    finally:
        await bus.close()
