"""Worker liveness: the pure tracker, then a real registry marking real workers dead and alive."""
from __future__ import annotations

import asyncio
import signal
import time

import pytest

from services.registry.liveness import LivenessTracker, needs_write
from shared.bus import Bus, BusSettings
from shared.events.registry import Bucket, CatalogChanged, WorkerRecord
from shared.events.worker import WorkerHeartbeat, WorkerState
from shared.nats_server import NatsServer
from shared.registry_client import RegistryClient
from shared.subjects import registry_changed, worker_heartbeat
from service_procs import ServiceProcess, eventually, wait_ready, write_config

DEAD_AFTER = 1.0  # tests/service_procs.TINY_CONFIG
TOLERANCE = 0.6  # timer wake-up + a KV write + event delivery, on a loaded 2-core machine
W = ("workers", "w0")


# --- the pure state machine ---------------------------------------------------------------
def test_new_peer_is_alive_and_silence_of_dead_after_marks_it_dead_once():
    t = LivenessTracker(dead_after=3.0)
    change = t.heard(W, 10.0, "inc-1")
    assert change is not None and change.alive and change.incarnation == "inc-1"
    assert t.heard(W, 11.0, "inc-1") is None  # still alive: no change
    assert t.expire(13.99) == []
    assert t.next_due() == 14.0
    dead = t.expire(14.0)
    assert len(dead) == 1 and not dead[0].alive and dead[0].key == W and dead[0].silent_s == pytest.approx(3.0)
    assert t.expire(20.0) == []  # reported once
    assert t.is_alive(W) is False and t.next_due() is None


def test_heartbeat_after_death_brings_peer_back_and_restart_is_reported():
    t = LivenessTracker(dead_after=1.0)
    t.heard(W, 0.0, "inc-1")
    t.expire(5.0)
    back = t.heard(W, 5.5, "inc-1")
    assert back is not None and back.alive and not back.restarted
    restarted = t.heard(W, 5.7, "inc-2")  # a new process with the same worker id
    assert restarted is not None and restarted.alive and restarted.restarted and restarted.incarnation == "inc-2"
    assert t.expire(6.6) == [] and len(t.expire(6.7)) == 1


def test_seeded_peers_get_a_full_dead_after_and_dead_ones_can_be_forgotten():
    t = LivenessTracker(dead_after=2.0, forget_after=10.0)
    t.seed(("services", "a"), 100.0, alive=True)
    t.seed(("services", "b"), 100.0, alive=False)
    assert t.expire(101.9) == []
    assert [c.key for c in t.expire(102.0)] == [("services", "a")]
    assert t.forgettable(109.9) == []
    assert sorted(t.forgettable(110.0)) == [("services", "a"), ("services", "b")]
    assert len(t) == 0


def test_out_of_order_heartbeat_time_never_moves_last_heard_back():
    t = LivenessTracker(dead_after=1.0)
    t.heard(W, 5.0)
    t.heard(W, 4.0)
    assert t.last_heard(W) == 5.0


def test_invalid_settings_are_refused():
    with pytest.raises(ValueError):
        LivenessTracker(dead_after=0)
    with pytest.raises(ValueError):
        LivenessTracker(dead_after=3.0, forget_after=1.0)


def test_needs_write_on_state_change_or_stale_timestamp_only():
    assert needs_write("ready", 100.0, "draining", 100.1, touch_every=0.5)
    assert not needs_write("ready", 100.0, "ready", 100.4, touch_every=0.5)
    assert needs_write("ready", 100.0, "ready", 100.5, touch_every=0.5)


# --- a real registry ------------------------------------------------------------------------
@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    root = tmp_path_factory.mktemp("liveness")
    server = NatsServer(store_dir=root / "nats").start()
    config = write_config(root)
    registry = ServiceProcess("registry", server.url, config, "registry-l1").start()
    try:
        yield server, config, registry
    finally:
        registry.stop()
        server.stop()


class Changes:
    """Collects CatalogChanged events of one bucket, with their arrival time."""

    def __init__(self) -> None:
        self.events: list[tuple[float, CatalogChanged]] = []

    async def on_event(self, event: CatalogChanged, _ctx) -> None:
        self.events.append((time.monotonic(), event))

    async def first(self, key: str, state: str, timeout: float = 10.0) -> float:
        async def found() -> float | None:
            for at, e in self.events:
                if e.key == key and e.record is not None and str(e.record.state) == state:
                    return at
            return None

        return await eventually(found, timeout=timeout, interval=0.02)


@pytest.fixture
async def bus(cluster):
    server, _config, registry = cluster
    bus = await Bus.connect(BusSettings(url=server.url), service="dispatcher")
    await wait_ready(bus, registry)
    yield bus
    await bus.close()


@pytest.mark.timeout(90)
async def test_silent_heartbeat_publisher_is_marked_dead_within_dead_after_and_alive_again(bus):
    registry = RegistryClient(bus)
    await registry.create(WorkerRecord(worker_id="hb-1", device="cpu", memory_capacity_bytes=1 << 20))
    changes = Changes()
    await bus.subscribe(registry_changed("workers"), CatalogChanged, changes.on_event)

    async def beat(seq: int) -> float:
        await bus.publish(worker_heartbeat(), WorkerHeartbeat(
            worker_id="hb-1", incarnation="hb-proc-1", seq=seq, ts=time.time(), state=WorkerState.READY))
        await bus.nc.flush()
        return time.monotonic()

    for seq in range(5):
        last = await beat(seq)
        await asyncio.sleep(0.2)
    await changes.first("hb-1", "ready")
    dead_at = await changes.first("hb-1", "dead")
    assert DEAD_AFTER - 0.05 <= dead_at - last <= DEAD_AFTER + TOLERANCE, dead_at - last
    stored = await registry.get(Bucket.WORKERS, "hb-1")
    assert stored.record.state == WorkerState.DEAD

    resumed = await beat(5)
    alive_at = await eventually(lambda: _alive_after(changes, "hb-1", dead_at), timeout=5)
    assert alive_at - resumed < 1.0
    assert (await registry.get(Bucket.WORKERS, "hb-1")).record.state == WorkerState.READY


async def _alive_after(changes: Changes, key: str, after: float) -> float | None:
    for at, e in changes.events:
        if at > after and e.key == key and e.record is not None and e.record.state == WorkerState.READY:
            return at
    return None


@pytest.mark.timeout(120)
async def test_killed_gpu_worker_process_is_marked_dead_and_its_service_record_too(cluster, bus):
    server, config, _ = cluster
    registry = RegistryClient(bus)
    heard: list[float] = []

    async def on_heartbeat(hb: WorkerHeartbeat, _ctx) -> None:
        if hb.worker_id == "w0":
            heard.append(time.monotonic())

    await bus.subscribe(worker_heartbeat(), WorkerHeartbeat, on_heartbeat)
    changes = Changes()
    await bus.subscribe(registry_changed("workers"), CatalogChanged, changes.on_event)
    worker = ServiceProcess("gpu_worker", server.url, config, "gpu_worker-w0-t1", "--worker-id", "w0").start()
    try:
        await wait_ready(bus, worker)
        await changes.first("w0", "ready", timeout=10)
        entry = await registry.get(Bucket.WORKERS, "w0")
        assert (entry.record.device, entry.record.memory_capacity_bytes) == ("cpu", 64 << 20)
        assert entry.record.incarnation.startswith("gpu_worker-w0-t1-")  # the service id and this process
        proc_entry = await registry.get(Bucket.SERVICES, "gpu_worker-w0-t1")
        assert proc_entry.record.service == "gpu_worker" and proc_entry.record.pid == worker.pid
        worker.stop(signal.SIGKILL)  # a crash: no drain, no goodbye
        dead_at = await changes.first("w0", "dead", timeout=10)
        assert DEAD_AFTER - 0.05 <= dead_at - heard[-1] <= DEAD_AFTER + TOLERANCE, dead_at - heard[-1]
        svc = await eventually(lambda: _service_state(registry, "gpu_worker-w0-t1", "dead"), timeout=5)
        assert svc.record.state == "dead"
    finally:
        worker.stop()


async def _service_state(registry: RegistryClient, key: str, state: str):
    entry = await registry.get(Bucket.SERVICES, key)
    return entry if entry is not None and entry.record.state == state else None


@pytest.mark.timeout(120)
async def test_sigterm_drains_worker_cleanly_deregisters_it_and_it_is_dead_after_silence(cluster, bus):
    server, config, _ = cluster
    registry = RegistryClient(bus)
    changes = Changes()
    await bus.subscribe(registry_changed("workers"), CatalogChanged, changes.on_event)
    worker = ServiceProcess("gpu_worker", server.url, config, "gpu_worker-w1-t1", "--worker-id", "w1").start()
    await wait_ready(bus, worker)
    await changes.first("w1", "ready", timeout=10)
    assert worker.stop(signal.SIGTERM) == 0  # drained and exited cleanly
    await changes.first("w1", "draining", timeout=5)
    assert await registry.get(Bucket.SERVICES, "gpu_worker-w1-t1") is None  # deregistered on the way out
    await changes.first("w1", "dead", timeout=5)
    assert (await registry.get(Bucket.WORKERS, "w1")).record.memory_capacity_bytes == 128 << 20
