"""Control commands authorized by sender (issue 27 item 5), on a real nats-server with `tidal up`'s per-role
users and a real registry + gpu_worker: the gateway's credentials load and unload adapters (the
`worker.adapters` subject) and nothing else — NATS refuses its model, group and migration commands on
`worker.ctl` (a permissions violation; the worker never sees them), and the worker decodes only adapter
commands on `worker.adapters`. The scheduler's credentials drive `worker.ctl`."""
from __future__ import annotations

import asyncio
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import nats
import nats.errors
import pytest

from service_procs import ServiceProcess, wait_ready
from services.gpu_worker.engine.checkpoint_gen import make_lora
from shared.bus import Bus, BusSettings
from shared.events.ctl import (
    CtlDone, CtlReply, DropLayers, EvictAdapter, EvictModel, JoinGroup, LoadAdapter, MigrateOut, Prewarm,
)
from shared.events.common import GroupMember, LayerRange
from shared.nats_server import NatsServer
from shared.nats_users import OPERATOR, NatsUsers
from shared.subjects import worker_adapters, worker_ctl
from shared.wire import RemoteError, encode
from worker_harness import INSTANCE, MODEL, make_assets

pytestmark = pytest.mark.timeout(300)
ADAPTER_NAME = "authz-lora"

# what the internet-facing gateway must never be able to send a worker
FORBIDDEN = [
    EvictModel(idempotency_key="gw-evict", model=MODEL),
    DropLayers(idempotency_key="gw-drop", instance_id=INSTANCE, group_id="g-forged",
               layers=LayerRange(start=0, end=1)),
    JoinGroup(idempotency_key="gw-join", group_id="g-forged", instance_id=INSTANCE,
              members=[GroupMember(worker_id="w0", instance_id=INSTANCE, layers=LayerRange(start=0, end=1)),
                       GroupMember(worker_id="w9", instance_id="w9-x", layers=LayerRange(start=1, end=2))]),
    MigrateOut(idempotency_key="gw-move", request_id="r-1", destination="w9", destination_instance="w9-x"),
    Prewarm(idempotency_key="gw-prewarm", model=MODEL, layers=LayerRange(start=0, end=2)),
]


@dataclass
class Cluster:
    nats: NatsServer
    directory: Path


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    directory = tmp_path_factory.mktemp("authz")
    config = make_assets(directory)
    make_lora(directory / ADAPTER_NAME, directory / "tiny", rank=4, targets=["q", "v"], seed=31)
    server = NatsServer(store_dir=directory / "nats", users=NatsUsers.generate()).start()
    procs = [ServiceProcess("registry", server.url_for("registry"), config, "registry-a"),
             ServiceProcess("gpu_worker", server.url_for("gpu_worker"), config, "worker-w0", "--worker-id", "w0",
                            "--threads", "1")]

    async def ready() -> None:
        bus = await Bus.connect(BusSettings(url=server.url_for(OPERATOR)), service="test")
        try:
            for proc in procs:
                await wait_ready(bus, proc, timeout=150)  # a worker imports torch: slow on a loaded box
        finally:
            await bus.close()

    try:
        for proc in procs:
            proc.start()
        asyncio.run(ready())
        yield Cluster(server, directory)
    finally:
        for proc in reversed(procs):
            proc.stop()
        server.stop()


async def test_the_gateway_loads_adapters_and_is_refused_every_other_worker_command(cluster: Cluster) -> None:
    gateway = await Bus.connect(BusSettings(url=cluster.nats.url_for("gateway")), service="gateway")
    errors: list[str] = []

    async def on_error(exc: Exception) -> None:
        errors.append(str(exc))

    raw = await nats.connect(cluster.nats.url_for("gateway"), error_cb=on_error, allow_reconnect=False)
    try:
        load = LoadAdapter(idempotency_key="gw-load", adapter=ADAPTER_NAME, base=MODEL,
                           path=str(cluster.directory / ADAPTER_NAME))
        loaded = await gateway.request(worker_adapters("w0"), load, CtlReply, timeout=30)
        assert isinstance(loaded, CtlDone) and loaded.command == "LoadAdapter", loaded

        for command in FORBIDDEN:
            subject = worker_ctl("w0")
            with pytest.raises(nats.errors.TimeoutError):  # dropped by the server: no worker ever answers
                await raw.request(subject, encode(command), timeout=1.0)
            for _ in range(100):
                if any(f'permissions violation for publish to "{subject}"' in e.lower() for e in errors):
                    break
                await asyncio.sleep(0.02)
            assert any(f'permissions violation for publish to "{subject}"' in e.lower() for e in errors), errors
            errors.clear()
            # nor can it smuggle them in on the adapter subject: the worker decodes adapter commands only
            with pytest.raises(RemoteError):
                await gateway.request(worker_adapters("w0"), command, CtlReply, timeout=10)

        unload = EvictAdapter(idempotency_key="gw-unload", adapter=ADAPTER_NAME)
        unloaded = await gateway.request(worker_adapters("w0"), unload, CtlReply, timeout=30)
        assert isinstance(unloaded, CtlDone), unloaded
    finally:
        await raw.close()
        await gateway.close()


async def test_the_scheduler_drives_worker_ctl(cluster: Cluster) -> None:
    scheduler = await Bus.connect(BusSettings(url=cluster.nats.url_for("scheduler")), service="scheduler")
    try:
        evicted = await scheduler.request(worker_ctl("w0"), EvictModel(idempotency_key="sched-evict", model=MODEL),
                                          CtlReply, timeout=30)
        assert isinstance(evicted, CtlDone) and evicted.command == "EvictModel", evicted
    finally:
        await scheduler.close()
